"""`quasar export --format compressed-tensors`: the W8A8 model as llm-compressor lays it out, loaded back by
transformers + compressed-tensors on CPU and compared with quasar's own W8A8 logits.

Two comparisons, because the activation rounding grids differ by design:
- exact layout: transformers (its compressed-tensors integration decompresses the int8 weights on CPU) with
  compressed-tensors' own activation fake-quant switched off and replaced by quasar's/vLLM's per-token rule
  (scale = absmax / 127): the logits must equal quasar's up to float summation order (TIGHT, relative).
- as loaded: compressed-tensors' fake quant uses scale = absmax / 127.5 and clamps to [-128, 127], a slightly
  different grid than vLLM's int8 kernel and quasar (absmax / 127): the logits agree within LOOSE (relative)
  and the greedy next token agrees on almost every position.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cache_at
import torch
import transformers
from safetensors import safe_open

from quasar.model.loading import LoadedModel
from quasar.verifiers.registry import load_verifier

pytest.importorskip("compressed_tensors")  # a test extra, not installable on Python 3.10
from compressed_tensors.compressors import IntQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig

TIGHT = 1e-4  # max |logit difference| / max |logit|, same activation grid
LOOSE = 0.05  # the same, compressed-tensors' absmax/127.5 activation grid vs quasar's absmax/127
PROMPT = "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published"


@pytest.fixture(autouse=True)
def own_cache(tmp_path):
    """Each test's quantized checkpoints in a fresh cache."""
    with cache_at(tmp_path / "cache") as cache:
        yield cache


@pytest.fixture(scope="module")
def w8a8(tiny_model_dir, tmp_path_factory) -> LoadedModel:
    """The per-channel/per-token scheme vLLM's int8 kernels run (the default `w8a8` is group-wise)."""
    with cache_at(tmp_path_factory.mktemp("cache")):
        return load_verifier(tiny_model_dir, "w8a8:pc:lmbf16", owned=False)  # as `quasar export` loads it


@pytest.fixture(scope="module")
def exported(w8a8, tmp_path_factory) -> Path:
    from quasar.tools.export import export

    return export(w8a8, tmp_path_factory.mktemp("export") / "ct")


def quasar_logits(loaded: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model(ids, loaded.model.new_cache(ids.shape[1]))[0]  # [T, V]


def per_token_int8(module: torch.nn.Module, args: tuple) -> tuple:
    """quasar's / vLLM's dynamic per-token int8 rule: scale = absmax / 127, round, clamp to +-127."""
    x = args[0]
    scale = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny) / 127
    return (torch.round(x / scale).clamp(-127, 127) * scale,)


def transformers_logits(out: Path, ids: torch.Tensor, quasar_grid: bool) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    assert len(quantized) == 7 * model.config.num_hidden_layers  # every decoder linear, not lm_head
    if quasar_grid:
        for m in quantized:
            m.quantization_enabled = False  # compressed-tensors' own fake quant off ...
            m.register_forward_pre_hook(per_token_int8)  # ... quasar's per-token rule on
    with torch.inference_mode():
        return model(ids).logits[0].float()  # [T, V]


def test_config_declares_int8_channel_weights_and_dynamic_token_activations(exported):
    config = json.loads((exported / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])  # the library's own schema
    assert qc.quant_method == "compressed-tensors" and qc.format == "int-quantized"
    assert qc.ignore == ["lm_head"]
    (group,) = qc.config_groups.values()
    assert group.targets == ["Linear"]
    w, a = group.weights, group.input_activations
    assert (w.num_bits, w.type, w.symmetric, w.strategy, w.dynamic) == (8, "int", True, "channel", False)
    assert (a.num_bits, a.type, a.symmetric, a.strategy, a.dynamic) == (8, "int", True, "token", True)
    assert "quantization" not in config  # quasar's own block is not carried over
    assert config["architectures"] == ["LlamaForCausalLM"]  # vLLM picks the model class from it
    assert (exported / "tokenizer.json").exists()


def test_int8_weights_and_scales_decompress_exactly(exported, w8a8):
    modules = dict(w8a8.model.named_modules())
    scheme = QuantizationConfig.model_validate(
        json.loads((exported / "config.json").read_text())["quantization_config"]).config_groups["group_0"]
    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        names = [k.removesuffix(".weight_scale") for k in f.keys() if k.endswith(".weight_scale")]  # noqa: SIM118
        assert len(names) == 7 * w8a8.model.config.num_hidden_layers
        for name in names:
            weight, scale = f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.weight_scale")
            assert weight.dtype == torch.int8 and scale.shape == (weight.shape[0], 1)
            ours = modules[name]
            dense = IntQuantizationCompressor.decompress({"weight": weight, "weight_scale": scale}, scheme)["weight"]
            assert torch.equal(dense.float(), ours.weight.float() * ours.weight_scale[:, None])
        norm = "model.layers.0.input_layernorm.weight"  # carries the smoothing factors
        assert torch.equal(f.get_tensor(norm), modules["model.layers.0.input_layernorm"].weight)
        assert f.get_tensor("lm_head.weight").is_floating_point()


def test_logits_round_trip_through_transformers(exported, w8a8):
    ids = torch.tensor([w8a8.tokenizer.encode(PROMPT)])  # [1, T]
    ours = quasar_logits(w8a8, ids)
    scale = ours.abs().max()
    same_grid = transformers_logits(exported, ids, quasar_grid=True)
    assert ((same_grid - ours).abs().max() / scale) < TIGHT
    as_loaded = transformers_logits(exported, ids, quasar_grid=False)
    assert ((as_loaded - ours).abs().max() / scale) < LOOSE
    assert (as_loaded.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.9


def test_export_command_writes_the_directory_atomically(tiny_model_dir, w8a8, tmp_path):
    out = tmp_path / "exported"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    cache = w8a8.directory.parent.parent  # the cache the fixture quantized into: no second calibration
    result = subprocess.run([sys.executable, "-m", "quasar", "export", "--model", str(tiny_model_dir), "--cache-dir",
                             str(cache), "--format", "compressed-tensors", "--out", str(out)],
                            check=True, capture_output=True, text=True, timeout=600)
    assert "exporting w8a8:pc:lmbf16, the nearest scheme vLLM runs" in result.stderr  # the default is g32, lm8
    assert not (out / "stale.txt").exists()
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".exported")]  # no temp sibling left


def test_export_refuses_a_float_model(tiny_model, tmp_path):
    from quasar.tools.export import export

    with pytest.raises(ValueError, match="no quantized linears"):
        export(tiny_model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_refuses_group_scales_vllm_cannot_run(tiny_model_dir, tmp_path):
    """A group-wise model is never written as if it were per channel: the writer refuses it, and a quantized
    g32 directory (no float weights to re-quantize from) is refused by the command with the reason."""
    from quasar.cli import main
    from quasar.tools.export import export

    grouped = load_verifier(tiny_model_dir, "w8a8:g32")
    with pytest.raises(ValueError, match="per group of 32 inputs"):
        export(grouped, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    checkpoint = tmp_path / "g32"
    assert main(["quantize", "--model", str(tiny_model_dir), "--scheme", "w8a8:g32", "--out", str(checkpoint),
                 "--calib-samples", "1", "--seq-len", "32"]) == 0
    assert main(["export", "--model", str(checkpoint), "--out", str(tmp_path / "ct")]) == 1
    assert not (tmp_path / "ct").exists()


def test_the_int8_lm_head_is_never_exported_as_float(tiny_model_dir, tmp_path):
    """quasar's w8a8 quantizes the lm_head too; vLLM's hand-off keeps it in float: the nearest scheme says so,
    and the writer refuses a model whose lm_head is int8 rather than drop it."""
    from quasar.tools.export import export, vllm_scheme

    from quasar.spec import VerifierSpec

    nearest, why = vllm_scheme(VerifierSpec.parse("w8a8:pc"))
    assert str(nearest) == "w8a8:pc:lmbf16" and "keeps its lm_head in W8A8" in why and "per group" not in why
    assert vllm_scheme(VerifierSpec.parse("w8a8:pc:lmbf16")) == (VerifierSpec.parse("w8a8:pc:lmbf16"), None)
    int8_head = load_verifier(tiny_model_dir, "w8a8:pc", owned=False)
    with pytest.raises(ValueError, match="lm_head is in W8A8.*--verifier w8a8:pc:lmbf16"):
        export(int8_head, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_verifier_loaded_to_run_is_refused_with_the_way_out(tiny_model_dir, tmp_path):
    from quasar.tools.export import export

    running = load_verifier(tiny_model_dir, "w8a8:pc:lmbf16")  # tied: packed once
    with pytest.raises(ValueError, match="packed copy: load the verifier with load_verifier"):
        export(running, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_vllm_dry_run_points_at_the_export(tiny_model_dir, w8a8, tmp_path):
    cache = w8a8.directory.parent.parent
    out = subprocess.run([sys.executable, "-m", "quasar", "serve", "--engine", "vllm", "--dry-run", "--model",
                          str(tiny_model_dir), "--cache-dir", str(cache), "--export-dir", str(tmp_path / "ct")],
                         check=True, capture_output=True, text=True, timeout=600)
    argv = out.stdout.split()
    assert argv[:3] == ["vllm", "serve", str(tmp_path / "ct")]
    assert "quantization_config" in json.loads((tmp_path / "ct" / "config.json").read_text())
