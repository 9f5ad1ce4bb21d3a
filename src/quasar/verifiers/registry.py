"""Verifiers: a VerifierSpec (quasar.spec: 'fp32', 'bf16', 'w8a8:g64', 'pruned:8', ...) decides the one model that
verifies, i.e. whose distribution the output follows. `load_verifier` is the only way commands, the API, the
server, the bench and fidelity get a target model, so a name means the same model everywhere.

Every loader returns the model with float or quantized weights; `load_verifier` then decides its execution plan
once (quasar.kernels.plan: quasar's CPU kernels or torch).
"""

from __future__ import annotations

from pathlib import Path

from quasar.kernels import native
from quasar.kernels.plan import prepare_
from quasar.model.loading import LoadedModel
from quasar.registry import lookup
from quasar.spec import VERIFIER_FORMS, VerifierSpec

# kind -> "module:function" loading (model, spec) -> LoadedModel
VERIFIERS: dict[str, str] = {
    "fp32": "quasar.verifiers.float:load_fp32",
    "bf16": "quasar.verifiers.float:load_bf16",
    "w8a8": "quasar.verifiers.quantized:load_quantized_verifier",
    "w8a16": "quasar.verifiers.quantized:load_quantized_verifier",
    "w4a8": "quasar.verifiers.w4a8:load_w4a8",
    "pruned": "quasar.verifiers.pruned:load_pruned",
}


def load_verifier(model: str | Path, spec: VerifierSpec | str,
                  owned: bool = True) -> LoadedModel:
    """The verifier `spec` names ('fp32', 'bf16', 'w8a8', 'w8a8:pc', 'pruned:8', ... or its VerifierSpec) on its
    plan. owned: only the verifier reads its weights, so the kernels' packed copy is the only one kept; False for a
    model whose state dict is read in the plain layout afterwards (exports)."""
    spec = VerifierSpec.parse(spec) if isinstance(spec, str) else spec
    loaded = lookup(VERIFIERS, spec.kind, "verifier", VERIFIER_FORMS)(model, spec)
    prepare_(loaded.model, owned=owned)
    native.release_memory()  # what loading freed (a float model read to build another form) goes back to the system
    return loaded
