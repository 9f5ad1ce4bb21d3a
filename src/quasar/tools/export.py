"""Export a quantized model in the compressed-tensors layout that llm-compressor writes and vLLM loads.

W8A8 ("int-quantized"): every decoder-layer linear stores `weight` int8 [N, K] and `weight_scale` [N, 1]
(symmetric, per output channel, float32); activations are quantized dynamically per token at run time,
so nothing is stored for them. The SmoothQuant factors are already folded into the RMSNorm weights, so
norms, embeddings and lm_head are plain float tensors. `config.json` gains `quantization_config`;
lm_head is listed in `ignore`. The directory is written atomically (temp sibling + rename).

Group-wise W8A8 (`w8a8:gN`, quasar's default) has no vLLM int8 kernel: vLLM's W8A8 int8 layers take
per-channel weights and per-token activations, and its hand-off keeps the lm_head in float (quasar's default
quantizes it too). `vllm_scheme` names the nearest scheme vLLM runs (`w8a8:pc:lmbf16`, same smoothing), and
`export` refuses grouped layers or an int8 lm_head rather than write what vLLM would misread.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from quasar.files import atomic_directory
from quasar.model.loading import LoadedModel
from quasar.model.config import CAUSAL_LM_CLASSES
from quasar.quant.int8 import Int8Linear
from quasar.spec import VerifierSpec

log = logging.getLogger("quasar")

_INT8_CHANNEL = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                 "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"}
_INT8_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
               "group_size": None, "block_structure": None, "actorder": None, "observer": None}

# quantized layer type -> (compressed-tensors format, the scheme of its config group)
SCHEMES: dict[type, tuple[str, dict[str, Any]]] = {
    Int8Linear: ("int-quantized", {"weights": _INT8_CHANNEL, "input_activations": _INT8_TOKEN}),
}
FORMATS = ("compressed-tensors",)
TOKENIZER_FILES_SKIP = ("config.json", "model.safetensors", "model.safetensors.index.json")


def vllm_scheme(verifier: VerifierSpec) -> tuple[VerifierSpec, str | None]:
    """The verifier to export for vLLM, and the one line that says why when it differs from `verifier`:
    w8a8 / w8a8:g32:0.5 -> w8a8:pc:lmbf16 / w8a8:pc:0.5:lmbf16."""
    from quasar.quant.recipe import recipe_for

    recipe = recipe_for(verifier) if verifier.quantized else None
    if recipe is None or recipe.scheme != "w8a8":
        raise ValueError(f"vLLM's int8 hand-off exports w8a8 schemes, not {str(verifier)!r}")
    nearest = replace(recipe, group_size=0, lm_head=False)
    if nearest == recipe:
        return verifier, None
    grouped = (f"scales int8 weights and activations per group of {recipe.group_size} inputs, which vLLM's int8 "
               "kernels do not run (per-channel weights, per-token activations only)")
    why = ([grouped] if recipe.group_size else []) + (
        ["keeps its lm_head in W8A8, which vLLM's hand-off takes in float"] if recipe.lm_head else [])
    return nearest.spec, f"{recipe.name} {' and '.join(why)}; exporting {nearest.name}, the nearest scheme vLLM runs"


def scheme_type(module: nn.Module) -> type | None:
    """The SCHEMES key of a quantized layer (on either backend: kernel layers subclass the torch ones)."""
    return next((kind for kind in SCHEMES if isinstance(module, kind)), None)


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if scheme_type(m) is not None}


def quantization_config(model: nn.Module) -> dict[str, Any]:
    """The `quantization_config` block of config.json, as llm-compressor writes it for this model."""
    layers = quantized_layers(model)
    if not layers:
        raise ValueError("the model has no quantized linears; load it with a quantized verifier (--verifier w8a8)")
    grouped = sorted({m.group_size for m in layers.values() if getattr(m, "group_size", 0)})
    if grouped:
        raise ValueError(f"the model's int8 scales are per group of {grouped[0]} inputs, which the compressed-tensors "
                         "int8 scheme vLLM runs cannot express; export a per-channel model (--verifier w8a8:pc, or "
                         "`quasar quantize --scheme w8a8:pc`)")
    if "lm_head" in layers:
        raise ValueError("the model's lm_head is in W8A8, which vLLM's compressed-tensors hand-off keeps in float; "
                         "export a bf16-lm_head model (--verifier w8a8:pc:lmbf16)")
    kinds = {scheme_type(m) for m in layers.values()}
    if len(kinds) > 1:
        raise ValueError("mixed quantization schemes cannot be exported as one config group")
    fmt, scheme = SCHEMES[kinds.pop()]
    unquantized = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in layers]
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None, "format": fmt, **scheme}},
        "ignore": unquantized,  # lm_head (and anything else left in float)
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
    }


def export_state(model: nn.Module, float_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors under Hugging Face names: int8 weights + [N, 1] float32 scales, float tensors in float_dtype."""
    layers = quantized_layers(model)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        if key.endswith(".weight") and tensor.dim() > 2:  # a loaded verifier keeps only the kernels' packed copy
            raise ValueError(f"{key} holds only the kernels' packed copy: load the verifier with "
                             "load_verifier(..., owned=False) to export it")
        module, _, leaf = key.rpartition(".")
        if module in layers and leaf == "weight_scale":
            tensor = tensor.float().reshape(-1, 1)  # [N, 1]
        elif tensor.is_floating_point():
            tensor = tensor.to(float_dtype)
        state[key] = tensor.detach().cpu().contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def _write(target: LoadedModel, out: Path) -> None:
    model = target.model
    float_dtype = model.dtype
    config = json.loads((target.directory / "config.json").read_text())
    config.pop("quantization", None)  # quasar's own checkpoint block; the export is described by quantization_config
    config["quantization_config"] = quantization_config(model)
    config["torch_dtype"] = str(float_dtype).removeprefix("torch.")
    if not config.get("architectures") and config.get("model_type") in CAUSAL_LM_CLASSES:  # vLLM needs it
        config["architectures"] = [CAUSAL_LM_CLASSES[config["model_type"]]]  # older GGUF conversions have none
    save_file(export_state(model, float_dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in target.directory.iterdir():
        if f.is_file() and f.name not in TOKENIZER_FILES_SKIP and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)


def export(target: LoadedModel, out: str | Path, fmt: str = "compressed-tensors") -> Path:
    """Write the quantized `target` to directory `out` (replaced atomically if it exists)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    out = Path(out)
    atomic_directory(out, lambda tmp: _write(target, tmp))
    log.info("exported %s as %s to %s", target.source, fmt, out)
    return out
