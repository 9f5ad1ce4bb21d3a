"""The one place an EngineSpec becomes an Engine: the CLI, the Python API, the server, the bench and the evals
all build theirs with `build_engine`.

    engine = build_engine(EngineSpec.parse("ngram+w8a8"), Verifiers("default"))

`Verifiers` loads each verifier once (quasar.verifiers.registry) and shares it between the engines built from it
(the bench runs several methods over one loaded model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quasar.decoding.autoregressive import autoregressive
from quasar.decoding.drafters.base import DrafterOptions
from quasar.decoding.engine import Decoder, Engine
from quasar.model.loading import LoadedModel
from quasar.spec import AUTO, EngineSpec, VerifierSpec
from quasar.verifiers.registry import load_verifier

if TYPE_CHECKING:
    from quasar.decoding.confidence_guard import ConfidenceGuard


@dataclass
class Verifiers:
    """Loaded verifiers of one model by spec, each loaded on first use. `quantized`: a `quasar quantize` directory
    the w8a8 / w8a16 verifiers load from instead of quantizing `model` themselves."""

    model: str | Path = "default"
    quantized: str | Path | None = None
    loaded: dict[VerifierSpec, LoadedModel] = field(default_factory=dict)

    def get(self, spec: VerifierSpec) -> LoadedModel:
        if spec not in self.loaded:
            source = self.quantized if self.quantized and spec.quantized else self.model
            self.loaded[spec] = load_verifier(source, spec)
        return self.loaded[spec]


def build_engine(spec: EngineSpec, verifiers: Verifiers, options: DrafterOptions | None = None,
                 max_context: int | None = None) -> Engine:
    """The engine `spec` names: its verifier (the top level), a cascade's middle level, the drafter and the guard."""
    options = options or DrafterOptions()
    target = verifiers.get(spec.top)
    middle = None if spec.middle is None else verifiers.get(spec.middle)
    guard = None
    if spec.guard is not None:
        from quasar.decoding.confidence_guard import ConfidenceGuard, guard_model

        guard = ConfidenceGuard(guard_model(verifiers.model, target), spec.guard)
    decoder = build_decoder(spec, target, options, middle, guard)
    return Engine(target, decoder, max_context=max_context, path=engine_path(target, middle))


def build_decoder(spec: EngineSpec, target: LoadedModel, options: DrafterOptions = DrafterOptions(),
                  middle: LoadedModel | None = None, guard: ConfidenceGuard | None = None) -> Decoder:
    """The plain loop, or speculative decoding with the drafter `spec` names. With a `middle` model, a cascade: the
    drafter drafts for `middle`, whose own output drafts for `target`. With a guard, positions where the target's
    margin is below the guard's are re-scored by the float model."""
    if not spec.speculative:
        return autoregressive
    from quasar.decoding.drafters import build_drafter
    from quasar.decoding.speculative import Speculative

    if middle is None:
        return Speculative(build_drafter(spec.drafter, target, options), spec.k, guard)
    from quasar.decoding.cascade import CascadeDrafter

    inner = build_drafter(spec.drafter, middle, options)
    return Speculative(CascadeDrafter(middle.model, inner, spec.k), AUTO)


def engine_path(target: LoadedModel, middle: LoadedModel | None = None) -> str:
    """The kernel paths that compute an engine's outputs, as reports print them beside their figures: the model's
    plan ('kernels:dpbusd', 'torch', ...), or a cascade's 'MIDDLE > TOP'."""
    top = target.model.plan.paths
    return top if middle is None else f"{middle.model.plan.paths} > {top}"
