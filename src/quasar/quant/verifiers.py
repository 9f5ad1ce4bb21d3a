"""Registers the 'w8a8' and 'w8a16' verifiers.

`w8a8[:pc|:gN][:ALPHA]` (recipe.parse_scheme: group size, default DEFAULT_W8A8_GROUP; ALPHA = auto (default),
none or a float) and `w8a16` on a float model quantize it on the fly with the default calibration set and
cache the result on disk, keyed by the source weights' sha256 and the recipe settings, like the GGUF cache.
A quantized directory (from `quasar quantize`) loads directly. Either way `finish_verifier` gives the model
its run-time form (the bf16 lm_head), so every command that names a verifier runs the same model.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from torch import nn

from quasar import __version__
from quasar.loading import LoadedModel, cache_root, load, resolve
from quasar.quant.bf16 import use_bf16_linears_
from quasar.quant.checkpoint import is_quantized_dir, load_quantized, save_quantized
from quasar.quant.recipe import QuantRecipe, parse_scheme, quantize_model
from quasar.verifiers import register

log = logging.getLogger("quasar")


def recipe_key(source_sha256: str, recipe: QuantRecipe) -> str:
    settings = {"source_sha256": source_sha256, "quasar_version": __version__, **recipe.settings()}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:32]


def quantized_cached(model: str | Path, recipe: QuantRecipe, cache_dir: str | Path | None = None) -> LoadedModel:
    """The quantized model for (float model, recipe), made and cached on first use."""
    loaded = load(model, "fp32", cache_dir)
    target = cache_root(cache_dir) / "quantized" / recipe_key(loaded.source_sha256, recipe)
    if not (target / "config.json").exists():
        log.info("quantizing %s (%s) once into %s", loaded.source, recipe.scheme, target)
        save_quantized(loaded, quantize_model(loaded, recipe), target, overwrite=True)
    return load_quantized(target)


def finish_verifier(loaded: LoadedModel) -> LoadedModel:
    """The run-time form of a quantized model: a float lm_head reads half the bytes as bf16 on the kernel."""
    if type(loaded.model.lm_head) is nn.Linear:
        use_bf16_linears_(loaded.model, ["lm_head"])
    return loaded


def _load(name: str, model: str | Path, cache_dir: str | Path | None) -> LoadedModel:
    recipe = parse_scheme(name)
    path = resolve(model, cache_dir)
    if is_quantized_dir(path):
        loaded = load_quantized(path)
        block = json.loads((path / "config.json").read_text())["quantization"]
        group = block.get("group_size", 0)
        found = block["scheme"] + ((f":g{group}" if group else ":pc") if block["scheme"] == "w8a8" else "")
        explicit = any(part == "pc" or part[:1] == "g" for part in name.split(":")[1:])  # a group named, not only alpha
        if block["scheme"] != recipe.scheme or (explicit and group != recipe.group_size):
            raise ValueError(f"{path} is a {found} checkpoint, but --verifier asks for {name}")
    else:
        loaded = quantized_cached(model, recipe, cache_dir)
    return finish_verifier(loaded)


@register("w8a8")
def _w8a8(model: str | Path, arg: str | None, cache_dir: str | Path | None = None) -> LoadedModel:
    return _load(f"w8a8:{arg}" if arg else "w8a8", model, cache_dir)


@register("w8a16")
def _w8a16(model: str | Path, arg: str | None, cache_dir: str | Path | None = None) -> LoadedModel:
    return _load(f"w8a16:{arg}" if arg else "w8a16", model, cache_dir)
