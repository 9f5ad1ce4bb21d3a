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
from quasar.model.loading import LoadedModel, build_model, load_tokenizer, read_config, read_safetensors
from quasar.model.config import ModelConfig
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


def load_quantized(directory: str | Path) -> LoadedModel:
    """Load a directory written by save_quantized: int8 layers, float32 embeddings and norms, and the lm_head
    in bf16 unless it is quantized (checkpoints store it so; older ones, in float32, are rounded here alike)."""
    directory = Path(directory)
    hf = read_config(directory)
    block = hf["quantization"]
    _check(directory, block)
    try:
        scheme = scheme_config(block["scheme"], **block)
    except (ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(f"unsupported quantization block: {e}") from e
    quantized: set[str] = set()

    def prepare(model: Transformer) -> set[str]:  # the scheme's int8 linears in the empty model, by name
        quantized.update(prepare_empty_(model, scheme))
        return quantized

    model = build_model(ModelConfig.from_hf(hf), read_safetensors([directory / WEIGHTS]), torch.float32,
                        prepare=prepare)
    if "lm_head" not in quantized:
        use_bf16_linears_(model, ["lm_head"])
    log.info("loaded a %s checkpoint (%d quantized linears) from %s", block["scheme"], len(quantized), directory)
    return LoadedModel(model, load_tokenizer(directory), directory, directory, block["weights_sha256"])
