"""Verifier registry: a name such as 'bf16' or 'w8a8' -> a function that loads the target model that way.

A verifier is the model whose distribution the output follows. New kinds register themselves here
(quant/ registers w8a8 and w8a16); names may take one argument after a colon ('pruned:8').
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from quasar.loading import LoadedModel, load

VerifierLoader = Callable[..., LoadedModel]  # (model_spec, arg, cache_dir=...) -> LoadedModel
VERIFIERS: dict[str, VerifierLoader] = {}


def register(name: str) -> Callable[[VerifierLoader], VerifierLoader]:
    def wrap(fn: VerifierLoader) -> VerifierLoader:
        VERIFIERS[name] = fn
        return fn

    return wrap


@register("fp32")
def _fp32(model: str | Path, arg: str | None, cache_dir: str | Path | None = None) -> LoadedModel:
    return load(model, "fp32", cache_dir)


@register("bf16")
def _bf16(model: str | Path, arg: str | None, cache_dir: str | Path | None = None) -> LoadedModel:
    """bf16 weights. On a CPU with quasar's kernels: bf16 weights read by the AVX2 kernel, float32
    activations and sums (torch's bf16 GEMM is slow without AVX512-BF16, as llama.cpp does for BF16
    GGUFs); elsewhere the whole model in bf16."""
    from quasar.quant.bf16 import float32_activations_, use_bf16_linears_

    loaded = load(model, "bf16", cache_dir)
    if use_bf16_linears_(loaded.model):  # shares the bf16 weights; [] where the kernel cannot run
        float32_activations_(loaded.model)
    return loaded


def available() -> list[str]:
    _import_plugins()
    return sorted(VERIFIERS)


PLUGINS: tuple[str, ...] = ("quasar.pruning", "quasar.quant.verifiers")  # modules that register more verifiers, imported on first use (heavier)


def _import_plugins() -> None:
    import importlib

    for module in PLUGINS:
        importlib.import_module(module)


def load_verifier(model: str | Path, verifier: str, cache_dir: str | Path | None = None) -> LoadedModel:
    """'fp32', 'bf16', 'w8a8', 'pruned:8', ... -> the loaded verifier."""
    _import_plugins()
    name, _, arg = verifier.partition(":")
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r}; choose from {', '.join(sorted(VERIFIERS))}")
    return VERIFIERS[name](model, arg or None, cache_dir=cache_dir)
