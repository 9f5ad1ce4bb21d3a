"""Quantized checkpoints: save -> load is bit-identical; corrupt files are refused; atomic, --overwrite; cache."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from quasar.cli import main
from quasar.model.loading import ModelLoadError, load
from quasar.model.llama import Linear
from quasar.quant.calibration import CalibrationSpec
from quasar.quant.bf16 import BF16Linear
from quasar.quant.checkpoint import load_quantized, save_quantized
from quasar.quant.int8 import Int8Linear, Int8WeightOnlyLinear
from quasar.quant.recipe import QuantRecipe, quantize_model

SMALL = CalibrationSpec(samples=2, seq_len=64)


def _ids() -> torch.Tensor:
    return torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(5))


def _logits(model) -> torch.Tensor:
    return model(_ids(), model.new_cache(32))


@pytest.fixture(scope="module")
def quantized(tiny_model, tmp_path_factory):
    """(in-memory quantized model, its directory) for the tiny llama, W8A8 with alpha auto."""
    loaded = copy.deepcopy(tiny_model)
    block = quantize_model(loaded, QuantRecipe("w8a8", "auto", SMALL))
    return loaded, save_quantized(loaded, block, tmp_path_factory.mktemp("q") / "w8a8")


def test_save_load_gives_bit_identical_logits(quantized):
    loaded, directory = quantized
    reloaded = load_quantized(directory)  # no float weights involved
    assert isinstance(reloaded.model.model.layers[0].mlp.down_proj, Int8Linear)
    assert torch.equal(_logits(reloaded.model), _logits(loaded.model))


def test_quantization_block_records_the_recipe(quantized, tiny_model):
    _, directory = quantized
    block = json.loads((directory / "config.json").read_text())["quantization"]
    assert block["scheme"] == "w8a8" and block["alpha"] == "auto"
    assert len(block["alphas"]) == 4 * 2 and block["calibration"]["samples"] == 2
    assert block["source_sha256"] == tiny_model.source_sha256 and block["quasar_version"]
    assert (directory / "tokenizer.json").exists() or (directory / "tokenizer_config.json").exists()


def test_w8a16_round_trip_with_ignored_linears(tiny_model, tmp_path):
    loaded = copy.deepcopy(tiny_model)
    block = quantize_model(loaded, QuantRecipe("w8a16", None, ignore=("model.layers.1.mlp.*",)))
    reloaded = load_quantized(save_quantized(loaded, block, tmp_path / "w8a16"))
    assert isinstance(reloaded.model.model.layers[1].self_attn.o_proj, Int8WeightOnlyLinear)
    assert type(reloaded.model.model.layers[1].mlp.up_proj) is Linear  # kept in float
    assert torch.equal(_logits(reloaded.model), _logits(loaded.model))


def _copy_dir(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupted_checkpoint_is_refused(quantized, tmp_path):
    directory = _copy_dir(quantized[1], tmp_path / "bad")
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside the tensor data
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_quantized(directory)


def test_truncated_checkpoint_is_refused(quantized, tmp_path):
    directory = _copy_dir(quantized[1], tmp_path / "short")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_quantized(directory)


def test_output_is_replaced_only_with_overwrite(quantized, tmp_path):
    loaded, _ = quantized
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(ValueError, match="--overwrite"):
        save_quantized(loaded, {"scheme": "w8a8"}, out)
    save_quantized(loaded, {"scheme": "w8a8"}, out, overwrite=True)
    assert not (out / "keep").exists() and (out / "config.json").exists()


def test_interrupted_save_leaves_nothing(quantized, tmp_path, monkeypatch):
    from quasar.quant import checkpoint

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_file", fail)
    with pytest.raises(KeyboardInterrupt):
        save_quantized(quantized[0], {"scheme": "w8a8"}, tmp_path / "never")
    assert list(tmp_path.iterdir()) == []


def test_cli_quantize_then_generate_and_verifier_cache(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "q"
    args = ["quantize", "--model", str(tiny_model_dir), "--out", str(out), "--alpha", "0.5",
            "--calib-samples", "2", "--seq-len", "32"]
    assert main(args) == 0
    assert main(args) == 1 and "--overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    gen = ["generate", "hello", "--max-new-tokens", "3", "--no-chat", "--json"]
    assert main([*gen, "--model", str(out), "--verifier", "w8a8"]) == 0
    from_dir = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*gen, "--model", str(out), "--verifier", "w8a16"]) == 1  # scheme mismatch is an error
    capsys.readouterr()
    cache = tmp_path / "cache"
    for _ in range(2):  # second run reuses the on-the-fly quantization cached on disk
        assert main([*gen, "--model", str(tiny_model_dir), "--verifier", "w8a8:0.5", "--cache-dir", str(cache)]) == 0
    assert len(list((cache / "quantized").iterdir())) == 1
    assert len(from_dir["token_ids"]) == 3


def test_group_scheme_round_trip_and_block(tiny_model, tmp_path):
    """w8a8:g32 (the default w8a8) saves [N, K/32] scales, records its group size and reloads bit-identically."""
    loaded = copy.deepcopy(tiny_model)
    block = quantize_model(loaded, QuantRecipe("w8a8", "auto", SMALL, group_size=32))
    assert block["group_size"] == 32
    down = loaded.model.model.layers[0].mlp.down_proj
    assert down.group_size == 32 and down.weight_scale.shape == (64, 128 // 32)
    reloaded = load_quantized(save_quantized(loaded, block, tmp_path / "g32"))
    assert reloaded.model.model.layers[0].mlp.down_proj.weight_scale.shape == (64, 4)
    assert torch.equal(_logits(reloaded.model), _logits(loaded.model))


@pytest.mark.parametrize("scheme,message", [
    ("w8a9", "unknown verifier 'w8a9'"),
    ("w8a8:g48", "multiple of 32"),
    ("w8a8:g96", "group size 96 does not divide the 64 inputs of model.layers.0.self_attn.q_proj"),
    ("w8a8:g32:1.5", "alpha must lie in"),
    ("w8a16:g32", "takes no argument"),
])
def test_cli_quantize_bad_scheme_is_one_line_and_writes_nothing(tiny_model_dir, tmp_path, capsys, scheme, message):
    out = tmp_path / "q"
    args = ["quantize", "--model", str(tiny_model_dir), "--out", str(out), "--scheme", scheme, "--calib-samples", "1",
            "--seq-len", "32"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_quantize_calibration_file_without_text_writes_nothing(tiny_model_dir, tmp_path, capsys):
    empty = tmp_path / "calib.jsonl"
    empty.write_text('{"text": ""}\n')
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(tiny_model_dir), "--out", str(out), "--calib", str(empty)]) == 1
    assert "calibration text is empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.jsonl"]


def test_verifier_names_pick_the_scheme(tiny_model_dir, tmp_path, monkeypatch):
    from quasar import files
    from quasar.verifiers.registry import load_verifier

    cache = tmp_path / "cache"
    monkeypatch.setattr(files, "_cache_dir", cache)
    default = load_verifier(tiny_model_dir, "w8a8")
    assert default.model.model.layers[0].mlp.up_proj.group_size == 32
    assert load_verifier(tiny_model_dir, "w8a8:pc").model.model.layers[0].mlp.up_proj.group_size == 0
    assert load_verifier(tiny_model_dir, "w8a8:g64").model.model.layers[0].mlp.up_proj.group_size == 64
    assert isinstance(load_verifier(tiny_model_dir, "w8a8:lmbf16").model.lm_head, BF16Linear)  # on every host
    with pytest.raises(ValueError, match="'x' is neither pc, gN, lm8, lmbf16, awq, rtn, gptq, auto, none nor an alpha"):
        load_verifier(tiny_model_dir, "w8a8:x")


def test_w8a8_puts_the_lm_head_in_w8a8_too_and_lmbf16_keeps_it_in_bf16(tiny_model_dir, tmp_path, capsys):
    from quasar.quant.int8 import Int8Linear
    from quasar.quant.recipe import recipe_for
    from quasar.spec import VerifierSpec
    from quasar.verifiers.quantized import checkpoint_spec

    def parse_scheme(name: str):
        return recipe_for(VerifierSpec.parse(name))
    from quasar.verifiers.registry import load_verifier

    assert parse_scheme("w8a8").name == parse_scheme("w8a8:lm8").name == "w8a8:g32"
    assert parse_scheme("w8a8:pc:0.5:lmbf16").name == "w8a8:pc:0.5:lmbf16" and parse_scheme("w8a8:pc:0.5").lm_head
    assert parse_scheme("w8a16").lm_head is False  # weight-only keeps the bf16 lm_head
    head = load_verifier(tiny_model_dir, "w8a8", tmp_path / "cache").model.lm_head
    assert isinstance(head, Int8Linear) and head.group_size == 32
    int8_head, bf16_head = tmp_path / "q8", tmp_path / "q16"
    for out, flags in ((int8_head, []), (bf16_head, ["--lm-head", "bf16"])):
        assert main(["quantize", "--model", str(tiny_model_dir), "--out", str(out), "--calib-samples", "1",
                     "--seq-len", "32", *flags]) == 0
    assert str(checkpoint_spec(json.loads((int8_head / "config.json").read_text())["quantization"])) == "w8a8:g32"
    assert str(checkpoint_spec(json.loads((bf16_head / "config.json").read_text())["quantization"])) == "w8a8:g32:lmbf16"
    assert isinstance(load_verifier(bf16_head, "w8a8").model.lm_head, BF16Linear)  # plain w8a8 takes either head
    with pytest.raises(ValueError, match="is a w8a8:g32:lmbf16 checkpoint, but --verifier asks for w8a8:lm8"):
        load_verifier(bf16_head, "w8a8:lm8")
    with pytest.raises(ValueError, match="is a w8a8:g32 checkpoint, but --verifier asks for w8a8:lmbf16"):
        load_verifier(int8_head, "w8a8:lmbf16")


def test_a_name_loads_one_model_and_a_quantized_directory_is_no_float_model(tiny_model_dir, tmp_path, capsys):
    from quasar.verifiers.registry import load_verifier

    out = tmp_path / "q"
    assert main(["quantize", "--model", str(tiny_model_dir), "--out", str(out), "--scheme", "w8a16",
                 "--calib-samples", "1", "--seq-len", "32"]) == 0
    with pytest.raises(ModelLoadError, match="quantized checkpoint .*--verifier w8a16"):
        load(out, "fp32")
    with pytest.raises(ModelLoadError, match="quantized checkpoint"):
        load_verifier(out, "fp32")
    with pytest.raises(ValueError, match="is a w8a16 checkpoint, but --verifier asks for w8a8"):
        load_verifier(out, "w8a8")
    assert load_verifier(out, "w8a16").model.lm_head.weight.dtype == torch.bfloat16


def test_a_warm_cache_loads_no_float_model_and_the_quantizer_code_keys_it(tiny_model_dir, tmp_path, monkeypatch):
    """The cached checkpoint is found from the source's memoised sha256 alone; a change in the quantization
    code (its hash) makes a new checkpoint instead of reusing a stale one."""
    from quasar.model import loading
    from quasar.verifiers import quantized as quant_verifiers
    from quasar.verifiers.registry import load_verifier

    from quasar import files

    cache = tmp_path / "cache"
    monkeypatch.setattr(files, "_cache_dir", cache)
    first = load_verifier(tiny_model_dir, "w8a8")
    loaded_floats = []
    monkeypatch.setattr(quant_verifiers, "load", lambda *a, **k: loaded_floats.append(a) or loading.load(*a, **k))
    again = load_verifier(tiny_model_dir, "w8a8")
    assert loaded_floats == []
    assert torch.equal(again.model.model.layers[0].mlp.up_proj.weight, first.model.model.layers[0].mlp.up_proj.weight)
    assert len(list((cache / "quantized").iterdir())) == 1
    monkeypatch.setattr(quant_verifiers, "quant_code_sha256", lambda scheme: "a fix in the quantizer")
    load_verifier(tiny_model_dir, "w8a8")
    assert len(loaded_floats) == 1 and len(list((cache / "quantized").iterdir())) == 2


def test_the_bf16_lm_head_does_not_depend_on_the_host(tiny_model_dir, tmp_path):
    """The recipe rounds the lm_head to bf16 whether or not the kernels run, so a checkpoint (and an export)
    made on an AVX2 host equals one made on a host without them."""
    from quasar.quant.recipe import quantize_model, recipe_for
    from quasar.spec import VerifierSpec

    loaded = load(tiny_model_dir, "fp32")
    head = loaded.model.lm_head.weight.detach().clone()
    quantize_model(loaded, recipe_for(VerifierSpec.parse("w8a8:lmbf16"), CalibrationSpec(samples=1, seq_len=32)))
    assert isinstance(loaded.model.lm_head, BF16Linear) and type(loaded.model.lm_head) is BF16Linear  # no backend yet
    assert torch.equal(loaded.model.lm_head.weight, head.to(torch.bfloat16))


def test_the_float_model_used_for_calibration_is_freed_once_the_checkpoint_exists(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    import gc
    import weakref

    from quasar import files
    from quasar.verifiers import quantized as verifiers
    from quasar.verifiers.registry import load_verifier

    monkeypatch.setattr(files, "_cache_dir", tmp_path / "cache")
    floats = []

    def tracked(*args, **kwargs):
        loaded = load(*args, **kwargs)
        floats.append(weakref.ref(loaded.model))
        return loaded

    monkeypatch.setattr(verifiers, "load", tracked)
    gc.disable()  # freed as soon as its last reference goes, not at the next collection of cycles
    try:
        verifier = load_verifier(tiny_model_dir, "w8a8")
    finally:
        gc.enable()
    assert len(floats) == 1 and floats[0]() is None
    assert verifier.model is not None
