"""F16 / Q8_0 GGUF copies for the llama.cpp peers: metadata kept, tensors re-encoded, values preserved."""

from __future__ import annotations

import numpy as np
import pytest

import gguf  # noqa: E402  (a core dependency)

from gguf.quants import dequantize

from quasar.tools.bench.gguf_export import encode, exported_gguf, write_copy
from quasar.model.loading import open_gguf
from quasar.model.source import ModelSource

Q = gguf.GGMLQuantizationType


def small_gguf(path):
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list(["<s>", "a", "b"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tensors = {
        "blk.0.attn_q.weight": rng.standard_normal((8, 64)).astype(np.float32),
        "blk.0.ffn_down.weight": rng.standard_normal((4, 48)).astype(np.float32),  # 48 is not a multiple of 32
        "blk.0.attn_norm.weight": rng.standard_normal(64).astype(np.float32),
    }
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.mark.parametrize("precision, weight_type, down_type", [("q8_0", Q.Q8_0, Q.F16), ("f16", Q.F16, Q.F16),
                                                               ("bf16", Q.BF16, Q.BF16)])
def test_copy_keeps_metadata_and_values(tmp_path, precision, weight_type, down_type):
    tensors = small_gguf(tmp_path / "src.gguf")
    write_copy(tmp_path / "src.gguf", tmp_path / "out.gguf", precision)
    reader = open_gguf(tmp_path / "out.gguf")
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "b"]
    assert reader.fields["llama.block_count"].contents() == 1
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType[f"MOSTLY_{precision.upper()}"]
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types == {"blk.0.attn_q.weight": weight_type, "blk.0.ffn_down.weight": down_type, "blk.0.attn_norm.weight": Q.F32}
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).reshape(tensors[t.name].shape)
        assert np.abs(values - tensors[t.name]).max() < 0.05  # Q8_0: absmax / 127 per block of 32


def test_encode_choices():
    weights = np.linspace(-1, 1, 64 * 2, dtype=np.float32).reshape(2, 64)
    data, kind = encode(weights, "q8_0")
    assert kind == Q.Q8_0 and np.abs(dequantize(data, kind) - weights).max() < 1 / 127
    assert encode(weights[0], "q8_0")[1] == Q.F32


def test_llamacpp_peers_need_a_gguf(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a Hugging Face directory, not a GGUF
    directory = ModelSource.at(tmp_path)
    with pytest.raises(ValueError, match="need a GGUF"):
        exported_gguf(directory, "q8_0")
    with pytest.raises(ValueError, match="unknown GGUF precision"):
        exported_gguf(directory, "q4_0")


def test_a_llama_cpp_that_crashes_in_its_probe_is_skipped_with_the_reason(monkeypatch, tmp_path):
    """llama.cpp runs in the bench's process, so it is tried in a child first: a crash there (ggml's AMX path
    segfaults on some CPUs) becomes one line that says why and how to rebuild, not the end of the run."""
    from quasar.tools.bench import peers

    crash = "import os, signal\nprint('CPU : AVX512 = 1 | AMX_INT8 = 1 |', flush=True)\nos.kill(os.getpid(), signal.SIGSEGV)\n"
    monkeypatch.setattr(peers, "LLAMA_PROBE", crash)
    why = peers.llama_cpp_fails(str(tmp_path / "crash.gguf"), 2)
    assert why.startswith("llama.cpp failed a probe run on this CPU (signal 11)")
    assert "GGML_AMX_INT8=OFF" in why
    monkeypatch.setattr(peers, "LLAMA_PROBE", "import sys\nsys.exit('no such file')\n")
    assert peers.llama_cpp_fails(str(tmp_path / "missing.gguf"), 2) == (
        "llama.cpp failed a probe run on this CPU (exit status 1: no such file)")
    monkeypatch.setattr(peers, "LLAMA_PROBE", "print('ok')\n")
    assert peers.llama_cpp_fails(str(tmp_path / "fine.gguf"), 2) is None
