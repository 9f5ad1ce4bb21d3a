"""GGUF loading: our tensors equal the gguf package's dequantization, logits equal transformers' GGUF loader,
the cache round trip is bit-identical, and truncated files are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_hf_model
from helpers import cache_at
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from quasar.files import sha256_file
from quasar.model.loading import ModelLoadError, default_model_path, gguf_directory, load, unpermute_rope
from quasar.model.source import ModelSource

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
K_BLOCKS = {Q.Q4_K: (144, [0, 2]), Q.Q5_K: (176, [0, 2]), Q.Q6_K: (210, [208])}  # bytes/256 values, fp16 scale offsets
GGUF_LINEARS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert step for q/k rows (the inverse of unpermute_rope)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF bytes for w. The gguf package cannot quantize K-quants: those get random blocks with sane scales."""
    if qtype not in K_BLOCKS:
        return quantize(w, qtype)
    size, scale_offsets = K_BLOCKS[qtype]
    blocks = rng.integers(0, 256, (w.size // 256, size), dtype=np.uint8)
    for off in scale_offsets:
        blocks[:, off : off + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return blocks.reshape(w.shape[0], -1)


def write_tiny_gguf(path, tokenizer_reader: GGUFReader) -> dict[str, tuple[np.ndarray, Q]]:
    """A 2-layer llama GGUF whose linears cycle through every supported tensor type."""
    hf = tiny_hf_model("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    cfg, rng, raw = hf.config, np.random.default_rng(0), {}
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        field = tokenizer_reader.fields[key]
        value = field.contents()
        vtype = field.types[0]
        writer.add_key_value(key, value, vtype, sub_type=field.types[-1] if len(field.types) > 1 else None)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    tensors = {"token_embd.weight": (state["model.embed_tokens.weight"], Q.Q8_0),
               "output.weight": (state["lm_head.weight"], Q.F16),
               "output_norm.weight": (state["model.norm.weight"], Q.F32)}
    for i, (kind, qtype) in enumerate((k, TYPES[(n + 3 * layer) % len(TYPES)])
                                      for layer in range(2) for n, k in enumerate(GGUF_LINEARS)):
        layer = i // len(GGUF_LINEARS)
        w = state[f"model.layers.{layer}.{'self_attn' if 'proj' in kind and kind[0] in 'qkvo' else 'mlp'}.{kind}.weight"]
        if kind in ("q_proj", "k_proj"):
            w = permute(w, 4 if kind == "q_proj" else 2)
        tensors[f"blk.{layer}.{GGUF_LINEARS[kind]}.weight"] = (w, qtype)
    for layer in range(2):
        tensors[f"blk.{layer}.attn_norm.weight"] = (state[f"model.layers.{layer}.input_layernorm.weight"], Q.F32)
        tensors[f"blk.{layer}.ffn_norm.weight"] = (state[f"model.layers.{layer}.post_attention_layernorm.weight"], Q.F32)
    for name, (w, qtype) in tensors.items():
        data = encode(w, qtype, rng)
        raw[name] = (data, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape if qtype == Q.F32 else None, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return raw


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    raw = write_tiny_gguf(path, GGUFReader(str(default_model_path())))
    return path, raw


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """Each GGUF of these tests converted into a fresh cache."""
    with cache_at(tmp_path_factory.mktemp("cache")) as cache:
        yield cache


def test_cached_tensors_equal_the_gguf_package_dequantization(tiny_gguf):
    """Bit-identical through dequantize -> safetensors cache -> read back, for every tensor type."""
    path, raw = tiny_gguf
    assert {qtype for _, qtype in raw.values()} >= set(TYPES)
    directory = gguf_directory(ModelSource.at(path))
    ours = load_file(str(directory / "model.safetensors"))
    from quasar.model.loading import hf_name

    for name, (data, qtype) in raw.items():
        expected = torch.from_numpy(dequantize(data, qtype).copy()).float()
        if "attn_q." in name or "attn_k." in name:
            expected = unpermute_rope(expected, 4 if "attn_q." in name else 2)
        assert torch.equal(ours[hf_name(name)], expected.reshape(ours[hf_name(name)].shape)), name


def test_tiny_gguf_logits_match_transformers_gguf_loader(tiny_gguf):
    from transformers import AutoModelForCausalLM

    path, _ = tiny_gguf
    ours = load(path, "fp32").model
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids, ours.new_cache(32)) - hf(ids).logits).abs().max().item() <= 1e-4


def test_truncated_gguf_is_refused(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    data = path.read_bytes()
    for cut in (len(data) // 2, 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated|not a readable GGUF"):
            with cache_at(tmp_path / "cache"):
                load(bad)
    assert not list((tmp_path / "cache" / "gguf").glob("*/config.json"))


def test_default_model_sha256_is_pinned():
    from quasar.model.loading import DEFAULT_MODEL_SHA256

    assert sha256_file(default_model_path()) == DEFAULT_MODEL_SHA256


def test_the_fast_tokenizer_equals_auto_tokenizer(default_model):
    """loading.load_tokenizer skips AutoTokenizer's config imports; the tokens and chat text must not change."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(default_model.directory))
    ours = default_model.tokenizer
    for text in ("Hello world", " spaced  text\n\n\tx", "def f(x):\n    return x  # ünïcode ✓", ""):
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(auto.encode(text)) == auto.decode(auto.encode(text))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == auto.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    assert (ours.eos_token_id, ours.bos_token_id, len(ours)) == (auto.eos_token_id, auto.bos_token_id, len(auto))


def header_only_gguf(path, arch: str, **fields) -> None:
    """A GGUF with an architecture's hyper-parameters and no tensors: enough for gguf_config."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(18)
    writer.add_embedding_length(640)
    writer.add_feed_forward_length(2048)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_key_length(256)
    writer.add_token_list(["a", "b"])
    for key, value in fields.items():
        writer.add_string(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_of_another_architecture_gets_one_line_naming_the_families(tmp_path):
    from quasar.files import ModelLoadError
    from quasar.model.gguf_file import read_gguf_header
    from quasar.model.loading import gguf_config

    header_only_gguf(tmp_path / "x.gguf", "phi3")
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'phi3'; supported: llama, .*gemma3"):
        gguf_config(read_gguf_header(tmp_path / "x.gguf"))


def test_a_gemma3_gguf_with_rope_scaling_is_refused_not_misread(tmp_path):
    from quasar.model.config import UnsupportedModelError
    from quasar.model.gguf_file import read_gguf_header
    from quasar.model.loading import gguf_config

    header_only_gguf(tmp_path / "plain.gguf", "gemma3")
    config = gguf_config(read_gguf_header(tmp_path / "plain.gguf"))
    assert config["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["query_pre_attn_scalar"] == 256
    header_only_gguf(tmp_path / "scaled.gguf", "gemma3", **{"rope.scaling.type": "linear"})
    with pytest.raises(UnsupportedModelError, match="rope scaling"):
        gguf_config(read_gguf_header(tmp_path / "scaled.gguf"))


def test_open_gguf_reads_what_the_gguf_package_reads():
    """open_gguf parses on plain arrays instead of numpy memmap slices (several times faster on a 150k-token
    vocabulary) and gives the gguf package's own fields and tensors."""
    from quasar.model.loading import open_gguf

    path = default_model_path()
    ours, theirs = open_gguf(path), GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert field.types == ours.fields[name].types and len(field.data) == len(ours.fields[name].data)
        assert all(np.array_equal(a, b) for a, b in zip(field.parts, ours.fields[name].parts)), name
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == [
        (t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))
    assert type(ours.tensors[0].data) is np.ndarray  # no memmap subclass: the slices cost a plain view each
