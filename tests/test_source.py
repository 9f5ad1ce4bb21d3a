"""The model source, resolved once where a command starts: what each kind of model argument becomes, the verifier
'auto' picks for it, and a GGUF run on its own blocks without a float copy."""

from __future__ import annotations

import json
import time

import pytest
from helpers import cache_at, default_source, run_cli, share_kernels

from quasar.builder import bind, model_source
from quasar.files import ModelLoadError, cache_root
from quasar.model.gguf_file import read_gguf_header
from quasar.model.source import ModelSource
from quasar.spec import EngineSpec, VerifierSpec
from quasar.verifiers.registry import fitting, load_verifier


def test_the_default_model_is_a_quantized_gguf_read_from_its_header():
    source = default_source()
    assert (source.name, source.format, source.family) == ("default", "gguf", "llama")
    assert source.quantized_file and source.weights[0] == "Q4_1" and "Q8_0" in source.weights
    assert source.sha256 == source.pinned_sha256


def test_the_mapped_file_reads_what_the_gguf_package_reads():
    """Header fields, the vocabulary's length and every tensor (name, shape, type, offset, bytes) as gguf's own reader
    gives them, with the header's arrays skipped."""
    import numpy as np

    from quasar.model.loading import map_gguf, open_gguf

    path = default_source().path
    ours, theirs = map_gguf(path), open_gguf(path)
    for key in ("general.file_type", "general.architecture", "llama.embedding_length", "llama.block_count"):
        assert ours.field(key) == theirs.fields[key].contents(), key
    assert ours.header.array_length("tokenizer.ggml.tokens") == len(theirs.fields["tokenizer.ggml.tokens"].data)
    assert read_gguf_header(path).tensors == ours.header.tensors
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.data_offset, a.n_bytes) == (b.name, b.tensor_type, b.data_offset, b.n_bytes)
        assert tuple(a.shape) == tuple(int(d) for d in b.shape) and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data)


def test_a_truncated_or_foreign_file_is_one_clear_error(tmp_path):
    data = default_source().path.read_bytes()[:5000]  # the header's vocabulary is cut off
    (tmp_path / "cut.gguf").write_bytes(data)
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        ModelSource.at(tmp_path / "cut.gguf")
    (tmp_path / "text.gguf").write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        ModelSource.at(tmp_path / "text.gguf")
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ModelLoadError, match="neither a model directory nor a .gguf"):
        ModelSource.at(tmp_path / "weights.bin")
    with pytest.raises(ModelLoadError, match="does not exist"):
        model_source(tmp_path / "missing.gguf")


def test_a_directory_is_a_float_or_a_quantized_source(tiny_model_dir, tmp_path):
    source = ModelSource.at(tiny_model_dir)
    assert (source.format, source.family, source.weights, source.quantized_file) == ("hf", "llama", ("float",), False)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"quantization": {"scheme": "w8a8", "group_size": 32}}))
    held = ModelSource.at(checkpoint)
    assert (held.format, held.weights) == ("quantized", ("w8a8",))


def test_auto_fits_the_source(tiny_model_dir, tmp_path):
    auto = VerifierSpec("auto")
    assert fitting(auto, default_source()) == VerifierSpec("gguf")
    assert fitting(auto, ModelSource.at(tiny_model_dir)) == VerifierSpec("w8a8")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    block = {"scheme": "w8a8", "group_size": 32, "lm_head_dtype": "int8"}
    (checkpoint / "config.json").write_text(json.dumps(config | {"quantization": block}))
    assert fitting(auto, ModelSource.at(checkpoint)) == VerifierSpec("w8a8", group=32)


def test_plain_w4a8_is_the_gguf_alias_on_a_file_and_gguf_needs_one(tiny_model_dir):
    assert fitting(VerifierSpec.parse("w4a8"), default_source()) == VerifierSpec("gguf")
    assert fitting(VerifierSpec.parse("w4a8:g32:rtn"), default_source()) == VerifierSpec.parse("w4a8:g32:rtn")
    assert fitting(VerifierSpec.parse("w4a8"), ModelSource.at(tiny_model_dir)) == VerifierSpec("w4a8")
    with pytest.raises(ValueError, match="GGUF file's own blocks"):
        fitting(VerifierSpec("gguf"), ModelSource.at(tiny_model_dir))


def test_an_engine_spec_binds_every_level_and_the_guard_is_checked_after():
    assert str(bind(EngineSpec.parse("ngram+auto"), default_source())) == "ngram+gguf"
    assert str(bind(EngineSpec.parse("auto+bf16"), default_source())) == "ar:gguf+bf16"
    EngineSpec.parse("ngram+auto", guard=0.1)  # the guard's verifier is known only once bound
    with pytest.raises(ValueError, match="--guard"):
        bind(EngineSpec.parse("ngram+auto", guard=0.1), default_source())


def test_the_file_s_blocks_load_without_a_float_copy_or_a_calibration(tmp_path):
    source = default_source()
    with cache_at(tmp_path / "cache") as cache:
        loaded = load_verifier(source, "auto")
        made = sorted(p.name for p in cache.iterdir())
        metadata = [p.name for p in (cache / "gguf-metadata" / source.sha256).iterdir()]
    assert "gguf" not in made and "quantized" not in made, made  # no float conversion, no calibrated checkpoint
    assert "model.safetensors" not in metadata and "config.json" in metadata
    assert loaded.model.plan is not None
    assert loaded.tokenizer.encode("Hello")


def test_bad_arguments_are_refused_by_the_parser_before_anything_loads(tmp_path):
    """On a cold cache (nothing fetched, nothing compiled) each is one line naming the flag, exit status 2, and the
    cache stays empty: the check ran before any model was resolved, converted or calibrated."""
    cache = tmp_path / "cold"
    cases = {
        ("--drafter", "nonsense"): "--drafter",
        ("--temperature", "-1"): "--temperature",
        ("--top-p", "2"): "--top-p",
        ("--top-k", "-3"): "--top-k",
        ("--min-p", "1.5"): "--min-p",
        ("--k", "0"): "--k",
        ("--verifier", "w9a9"): "--verifier",
        ("--drafter", "layerskip:x"): "--drafter",
    }
    for flags, named in cases.items():
        started = time.perf_counter()
        done = run_cli("generate", "Hi", "--cache-dir", str(cache), *flags, timeout=60)
        assert done.returncode == 2, (flags, done.stderr)
        assert named in done.stderr and done.stderr.count("\n") == 1, done.stderr
        assert time.perf_counter() - started < 60
    done = run_cli("generate", "  ", "--cache-dir", str(cache), timeout=60)
    assert done.returncode == 2 and "PROMPT" in done.stderr and "empty" in done.stderr
    done = run_cli("generate", "-", "--cache-dir", str(cache), stdin="", timeout=60)
    assert done.returncode == 2 and "empty" in done.stderr
    assert not cache.exists() or not any(p for p in cache.iterdir() if p.name != "kernels"), list(cache.iterdir())


def test_generate_runs_a_gguf_on_its_own_blocks_by_default(tmp_path):
    cache = share_kernels(tmp_path / "cache")
    (cache / "packages").symlink_to(cache_root() / "packages", target_is_directory=True)  # the fetched default model
    done = run_cli("generate", "Name a color.", "--max-new-tokens", "4", "--cache-dir", str(cache), "--json")
    assert done.returncode == 0, done.stderr
    made = sorted(p.name for p in cache.iterdir())
    assert "gguf" not in made and "quantized" not in made, made  # no float copy, no calibration
    assert (cache / "gguf-metadata").is_dir()
    assert json.loads(done.stdout)["path"].startswith(("kernels:", "torch"))


def test_layers_packed_as_they_load_compute_what_layers_packed_after_compute():
    """gguf's load packs each layer for the kernels as it is made (owned); a load that keeps the plain blocks
    (owned=False) is packed by the plan afterwards: the same logits, bit for bit, on the same path."""
    import torch

    ids = torch.tensor([[1, 504, 3458, 314, 260, 1488, 30]])
    early, late = load_verifier(default_source(), "gguf"), load_verifier(default_source(), "gguf", owned=False)
    assert early.model.plan.paths == late.model.plan.paths
    with torch.inference_mode():
        assert torch.equal(early.model(ids, early.model.new_cache(16)), late.model(ids, late.model.new_cache(16)))


def test_the_gguf_tokenizer_is_the_one_transformers_builds(tmp_path):
    """The metadata conversion reads the tokenizer's keys alone; what it writes is what AutoTokenizer writes."""
    from transformers import AutoTokenizer

    from quasar.model.loading import gguf_config, write_metadata

    path = default_source().path
    ours, reference = tmp_path / "ours", tmp_path / "reference"
    ours.mkdir()
    write_metadata(path, gguf_config(read_gguf_header(path)), ours)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(reference))
    for file in sorted(reference.iterdir()):
        text = (ours / file.name).read_text()
        assert (json.loads(text) if file.suffix == ".json" else text) == (
            json.loads(file.read_text()) if file.suffix == ".json" else file.read_text()), file.name
