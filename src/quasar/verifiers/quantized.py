"""The 'w8a8' and 'w8a16' verifiers (names in quasar.verifiers.registry.VERIFIERS).

`w8a8[:pc|:gN][:ALPHA][:lm8|:lmbf16]` (quasar.spec, quant.recipe.recipe_for) and `w8a16` on a float model quantize it once with the default
calibration set and cache the checkpoint on disk. The cache key is the source weights' sha256 (memoised by
path, size and mtime), the recipe's settings and a hash of the quantization code, so a fix in the quantizer
makes new checkpoints instead of reusing stale ones; the float model is loaded only when the key misses. A
quantized directory (from `quasar quantize`) loads directly when its scheme matches the name. The lm_head's
format (W8A8, or bf16 with `:lmbf16`) is part of the recipe and of the checkpoint, so every command that names a
verifier runs one model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

from quasar.files import cache_root
from quasar.model.loading import LoadedModel, load
from quasar.model.source import ModelSource
from quasar.quant.checkpoint import load_quantized, save_quantized
from quasar.quant.recipe import QuantRecipe, quantize_model, recipe_for
from quasar.spec import VerifierSpec

log = logging.getLogger("quasar")
QUANT_DIR = Path(__file__).parents[1] / "quant"
QUANT_CODE = ("calibration.py", "checkpoint.py", "bf16.py", "int8.py", "recipe.py", "schemes.py", "smoothquant.py")
SCHEME_CODE = {"w4a8": ("w4a8.py",)}  # what decides one scheme's weights alone: a change there keeps the others' caches


@functools.cache
def quant_code_sha256(scheme: str = "w8a8") -> str:
    """A hash of the code that decides a scheme's quantized weights: any change to it invalidates cached checkpoints."""
    files = QUANT_CODE + SCHEME_CODE.get(scheme, ())
    return hashlib.sha256(b"".join((QUANT_DIR / name).read_bytes() for name in files)).hexdigest()


def recipe_key(source_sha256: str, recipe: QuantRecipe) -> str:
    settings = {"source_sha256": source_sha256, "quant_code": quant_code_sha256(recipe.scheme), **recipe.settings()}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:32]


def quantized_cached(model: ModelSource, recipe: QuantRecipe) -> LoadedModel:
    """The quantized model for (float model, recipe), made and cached on first use."""
    target = cache_root() / "quantized" / recipe_key(model.sha256, recipe)
    if not (target / "config.json").exists():
        quantize_into(model, recipe, target)  # the float model is freed here (load_verifier trims the heap after)
    return load_quantized(target)


def quantize_into(model: ModelSource, recipe: QuantRecipe, target: Path) -> None:
    """Calibrate and quantize the float model into the checkpoint `target`; the float model is freed on return."""
    loaded = load(model, "fp32")
    log.info("quantizing %s (%s) once into %s", loaded.source, recipe.name, target)
    save_quantized(loaded, quantize_model(loaded, recipe), target, cache=True)


def checkpoint_spec(block: dict) -> VerifierSpec:
    """The verifier a checkpoint's quantization block holds: w8a8:g32, w8a8:pc, w8a8:g32:lmbf16, w8a16, w4a8:g32:awq."""
    if block["scheme"] == "w4a8":
        return VerifierSpec("w4a8", group=block.get("group_size", 32), method=block.get("method", "awq"))
    if block["scheme"] != "w8a8":
        return VerifierSpec(block["scheme"])
    head = "lm8" if block.get("lm_head_dtype") == "int8" else "lmbf16"
    return VerifierSpec("w8a8", group=block.get("group_size", 0), lm_head=None if head == "lm8" else head)


def load_quantized_verifier(model: ModelSource, spec: VerifierSpec, owned: bool = True) -> LoadedModel:
    """The w8a8 / w8a16 verifier: a quantized directory loads as it is when it holds what `spec` names (the parts
    it names: plain 'w8a8' takes any group and lm_head); a float model is quantized once and cached."""
    recipe = recipe_for(spec)
    path, block = model.path, model.quantization
    if block is None:
        return quantized_cached(model, recipe)
    held = checkpoint_spec(block)
    if (held.kind != spec.kind or (spec.group is not None and held.group != spec.group)
            or (spec.method is not None and held.method != spec.method)
            or (spec.lm_head is not None and held.int8_lm_head != spec.int8_lm_head)):
        raise ValueError(f"{path} is a {held} checkpoint, but --verifier asks for {spec}")
    return load_quantized(path)
