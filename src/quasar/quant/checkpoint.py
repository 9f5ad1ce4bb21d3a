"""Quantized checkpoints: a Hugging Face-style directory whose config.json carries a `quantization` block.

model.safetensors holds int8 weights (`*.weight`, [N, K]), their float32 scales (`*.weight_scale`, [N]) and
the float tensors (embeddings, smoothed norms, biases; the lm_head in bf16 for `w8a8:...:lmbf16` and w8a16). The
block records the scheme, the alpha of every smoothing group, the calibration set, the sha256 of the source
weights and of model.safetensors (checked at load: a corrupted file is refused), and the quasar version. No float weights are needed to load.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from quasar.files import ModelLoadError, atomic_directory, sha256_file, sha256_memo
from quasar.model.loading import LoadedModel, load_tokenizer, read_config, read_safetensors
from quasar.model.config import ModelConfig
from quasar.model.families import model_for
from quasar.model.llama import Transformer
from quasar.quant.bf16 import use_bf16_linears_
from quasar.quant.schemes import prepare_empty_, scheme_config

log = logging.getLogger("quasar")
WEIGHTS = "model.safetensors"


def _state(model: Transformer) -> dict[str, torch.Tensor]:
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
        state.pop("lm_head.weight", None)  # shared with the embedding; re-tied at load
    return state


def save_quantized(loaded: LoadedModel, block: dict[str, Any], out: str | Path, overwrite: bool = False,
                   cache: bool = False) -> Path:
    """Write the quantized model in loaded.model to `out` atomically (temporary sibling + rename). A cache
    entry (cache=True) is keyed by its content: one written meanwhile by another process is kept."""
    out = Path(out)
    if out.exists() and not (overwrite or cache):
        raise ValueError(f"{out} already exists; pass --overwrite to replace it")
    config = {k: v for k, v in read_config(loaded.directory).items() if k != "quantization"}

    def write(tmp: Path) -> None:
        save_file(_state(loaded.model), str(tmp / WEIGHTS))
        quantization = {**block, "weights_sha256": sha256_file(tmp / WEIGHTS)}
        (tmp / "config.json").write_text(json.dumps({**config, "quantization": quantization}, indent=2))
        loaded.tokenizer.save_pretrained(str(tmp))

    atomic_directory(out, write, replace=not cache)
    log.info("wrote the %s checkpoint to %s", block["scheme"], out)
    return out


def _check(directory: Path, block: dict[str, Any]) -> None:
    weights = directory / WEIGHTS
    if not weights.exists():
        raise ModelLoadError(f"{directory} is a quantized checkpoint without {WEIGHTS}")
    if sha256_memo(weights) != block.get("weights_sha256"):
        raise ModelLoadError(
            f"{weights} does not match the sha256 recorded in its config.json: the quantized checkpoint is "
            "corrupt or was modified; re-create it with `quasar quantize --overwrite`"
        )


def _build(config: ModelConfig, block: dict[str, Any]) -> tuple[Transformer, set[str]]:
    with torch.device("meta"):
        model = model_for(config)
    try:
        quantized = set(prepare_empty_(model, scheme_config(block["scheme"], **block)))
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"unsupported quantization block: {e}") from e
    return model, quantized


def _prepare_state(model: Transformer, state: dict[str, torch.Tensor], quantized: set[str], dtype: torch.dtype):
    expected = dict(model.state_dict())
    if model.config.tie_word_embeddings and "lm_head" not in quantized:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"quantized checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    out = {}
    for name, ref in expected.items():
        tensor, module = state[name], name.rpartition(".")[0]
        if tensor.dtype != ref.dtype and (module in quantized or tensor.shape != ref.shape):
            raise ModelLoadError(f"tensor {name} has dtype {tensor.dtype}, expected {ref.dtype}")
        if tensor.shape != ref.shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(ref.shape)}")
        out[name] = tensor if module in quantized else tensor.to(dtype)
    return out


def load_quantized(directory: str | Path) -> LoadedModel:
    """Load a directory written by save_quantized: int8 layers, float32 embeddings and norms, and the lm_head
    in bf16 unless it is quantized (checkpoints store it so; older ones, in float32, are rounded here alike)."""
    directory = Path(directory)
    hf = read_config(directory)
    block = hf["quantization"]
    _check(directory, block)
    model, quantized = _build(ModelConfig.from_hf(hf), block)
    state = _prepare_state(model, read_safetensors([directory / WEIGHTS]), quantized, torch.float32)
    model.load_state_dict(state, strict=False, assign=True)
    if model.config.tie_word_embeddings and "lm_head" not in quantized:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rope()
    model = model.eval().requires_grad_(False)
    if "lm_head" not in quantized:
        use_bf16_linears_(model, ["lm_head"])
    log.info("loaded a %s checkpoint (%d quantized linears) from %s", block["scheme"], len(quantized), directory)
    return LoadedModel(model, load_tokenizer(directory), directory, directory, block["weights_sha256"])
