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
from quasar.model.source import ModelSource
from quasar.registry import lookup
from quasar.spec import AUTO, GGUF, VERIFIER_FORMS, VerifierSpec
from quasar.verifiers.quantized import checkpoint_spec

# kind -> "module:function" loading (model, spec, owned) -> LoadedModel
VERIFIERS: dict[str, str] = {
    "fp32": "quasar.verifiers.float:load_fp32",
    "bf16": "quasar.verifiers.float:load_bf16",
    "w8a8": "quasar.verifiers.quantized:load_quantized_verifier",
    "w8a16": "quasar.verifiers.quantized:load_quantized_verifier",
    "w4a8": "quasar.verifiers.w4a8:load_w4a8",
    "gguf": "quasar.verifiers.w4a8:load_file_blocks",
    "pruned": "quasar.verifiers.pruned:load_pruned",
}


def fitting(spec: VerifierSpec, source: ModelSource) -> VerifierSpec:
    """The verifier `spec` means on `source`: 'auto' is a quantized GGUF's own blocks (gguf), a `quasar quantize`
    checkpoint's own scheme, else w8a8; plain 'w4a8' on a GGUF file is gguf (its alias). gguf on anything but a
    GGUF file is refused here, before any load."""
    if spec.kind == AUTO:
        if source.quantized_file:
            return VerifierSpec(GGUF)
        return checkpoint_spec(source.quantization) if source.format == "quantized" else VerifierSpec("w8a8")
    if spec.file_blocks and source.format == "gguf":
        return VerifierSpec(GGUF)
    if spec.kind == GGUF:
        raise ValueError(f"--verifier gguf computes on a GGUF file's own blocks; {source.describe()}: use w8a8, or "
                         "w4a8:g32 for 4-bit blocks fitted to its weights")
    return spec


def load_verifier(model: ModelSource | Path, spec: VerifierSpec | str, owned: bool = True) -> LoadedModel:
    """The verifier `spec` names ('auto', 'gguf', 'fp32', 'bf16', 'w8a8', 'w8a8:pc', 'pruned:8', ... or its
    VerifierSpec) on its plan. owned: only the verifier reads its weights, so the kernels' packed copy is the only one
    kept; False for a model whose state dict is read in the plain layout afterwards (exports)."""
    model = ModelSource.of(model)
    spec = fitting(VerifierSpec.parse(spec) if isinstance(spec, str) else spec, model)
    loaded = lookup(VERIFIERS, spec.kind, "verifier", VERIFIER_FORMS)(model, spec, owned)
    prepare_(loaded.model, owned=owned)
    native.release_memory()  # what loading freed (a float model read to build another form) goes back to the system
    return loaded
