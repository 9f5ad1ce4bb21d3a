"""Verifiers: a name such as 'fp32', 'bf16', 'w8a8:g64' or 'pruned:8' decides the one model that verifies,
i.e. whose distribution the output follows. `load_verifier` is the only way commands, the API, the server,
the bench and fidelity get a target model, so a name means the same model everywhere.

Every loader returns the model with float or quantized weights; `load_verifier` then chooses its backend
once (quasar.kernels.plan: quasar's CPU kernels or torch).
"""

from __future__ import annotations

from pathlib import Path

from quasar.kernels import plan
from quasar.model.loading import LoadedModel, load
from quasar.registry import lookup

# name -> "module:function" loading (model, arg or None, cache_dir) -> LoadedModel
VERIFIERS: dict[str, str] = {
    "fp32": "quasar.verifiers.registry:load_fp32",
    "bf16": "quasar.verifiers.registry:load_bf16",
    "w8a8": "quasar.verifiers.quantized:load_w8a8",
    "w8a16": "quasar.verifiers.quantized:load_w8a16",
    "pruned": "quasar.verifiers.pruned:load_pruned",
}
FORMS = "fp32, bf16, w8a8[:pc|:gN][:ALPHA][:lm8|:lmbf16], w8a16, pruned:N"


def load_fp32(model: str | Path, arg: str | None, cache_dir: str | Path | None = None) -> LoadedModel:
    no_argument("fp32", arg)
    return load(model, "fp32", cache_dir)


def load_bf16(model: str | Path, arg: str | None, cache_dir: str | Path | None = None) -> LoadedModel:
    """bf16 weights, every linear's input rounded to bf16, float32 sums, norms, attention and KV cache (as
    llama.cpp runs BF16 GGUFs): vdpbf16ps on CPUs with AVX512-BF16, the same floats from AVX2 elsewhere."""
    from quasar.quant.bf16 import float32_activations_, use_bf16_linears_

    no_argument("bf16", arg)
    loaded = load(model, "bf16", cache_dir)
    use_bf16_linears_(loaded.model, bf16_inputs=True)  # shares the bf16 weights
    float32_activations_(loaded.model)
    return loaded


def no_argument(name: str, arg: str | None) -> None:
    if arg:
        raise ValueError(f"the {name} verifier takes no argument (got {name}:{arg})")


def available() -> list[str]:
    return sorted(VERIFIERS)


def load_verifier(model: str | Path, verifier: str, cache_dir: str | Path | None = None,
                  owned: bool = True) -> LoadedModel:
    """'fp32', 'bf16', 'w8a8', 'w8a8:pc', 'pruned:8', ... -> the loaded verifier, on its backend. owned: only
    the verifier reads its weights, so the kernels' packed copy is the only one kept; False for a model whose
    state dict is read in the plain layout afterwards (exports)."""
    name, _, arg = verifier.partition(":")
    loaded = lookup(VERIFIERS, name, "verifier", FORMS)(model, arg or None, cache_dir=cache_dir)
    plan.prepare_(loaded.model, cache_dir=cache_dir, owned=owned)
    return loaded
