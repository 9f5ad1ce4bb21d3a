"""The one place an EngineSpec becomes an Engine: the CLI, the Python API, the server, the bench and the evals
all build theirs with `build_engine`.

    engine = build_engine(EngineSpec.parse("ngram+auto"), Verifiers(model_source("default")))

`model_source` is where a model argument ('default', an installed name, a path) becomes the one `ModelSource` every
layer below takes. `Verifiers` loads each verifier once (quasar.verifiers.registry) and shares it between the engines
built from it (the bench runs several methods over one loaded model); `bind` turns 'auto' (and plain w4a8 on a GGUF)
into the verifier that fits the source.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from quasar.decoding.autoregressive import autoregressive
from quasar.decoding.drafters.base import DrafterOptions
from quasar.decoding.engine import Decoder, Engine
from quasar.model.loading import DEFAULT_MODEL_SHA256, LoadedModel, default_model_path
from quasar.model.source import ModelSource
from quasar.spec import AUTO, GGUF, EngineSpec, VerifierSpec
from quasar.tools.model_store import installed_model
from quasar.verifiers.registry import fitting, load_verifier

log = logging.getLogger("quasar")

if TYPE_CHECKING:
    from quasar.decoding.confidence_guard import ConfidenceGuard


def model_source(model: str | Path | ModelSource) -> ModelSource:
    """'default' (the embedded model, sha256-pinned), an installed name (`quasar models install`), a .gguf file or
    a model directory -> its ModelSource, read once here for every layer below."""
    if isinstance(model, ModelSource):
        return model
    if str(model) == "default":
        return ModelSource.at(default_model_path(), "default", pinned_sha256=DEFAULT_MODEL_SHA256)
    installed = installed_model(str(model))
    return ModelSource.at(installed or Path(model), str(model))


def say_float_copy(spec: VerifierSpec, source: ModelSource) -> None:
    """One line when a verifier makes a float copy of a quantized GGUF (every kind but gguf): its memory and why."""
    if source.quantized_file and spec.kind != GGUF:
        size = source.float_bytes()
        cost = f" (about {size / 1e9:.1f} GB in memory)" if size else ""
        made = "calibrates and quantizes it once (cached)" if spec.quantized or spec.calibrated_blocks else "runs it"
        log.warning("--verifier %s on the quantized GGUF %s dequantizes it to a float32 copy%s and %s; --verifier "
                    "gguf (auto's choice) runs the file's own blocks as they are", spec, source.path.name, cost, made)


def bind(spec: EngineSpec, source: ModelSource) -> EngineSpec:
    """`spec` with each level the verifier that fits `source` ('auto', plain w4a8 on a GGUF -> gguf, ...)."""
    return replace(spec, levels=tuple(fitting(level, source) for level in spec.levels))


@dataclass
class Verifiers:
    """Loaded verifiers of one model by spec, each loaded on first use. `quantized`: a `quasar quantize` directory
    the w8a8 / w8a16 verifiers load from instead of quantizing `model` themselves."""

    model: ModelSource
    quantized: ModelSource | None = None
    loaded: dict[VerifierSpec, LoadedModel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.model = model_source(self.model)
        self.quantized = None if self.quantized is None else model_source(self.quantized)

    def get(self, spec: VerifierSpec) -> LoadedModel:
        spec = fitting(spec, self.model)
        if spec not in self.loaded:
            source = self.quantized if self.quantized and spec.quantized else self.model
            say_float_copy(spec, source)
            self.loaded[spec] = load_verifier(source, spec)
        return self.loaded[spec]


def build_engine(spec: EngineSpec, verifiers: Verifiers, options: DrafterOptions | None = None,
                 max_context: int | None = None) -> Engine:
    """The engine `spec` names: its verifier (the top level), a cascade's middle level, the drafter and the guard."""
    spec = bind(spec, verifiers.model)
    options = drafter_options(spec, options or DrafterOptions())
    target = verifiers.get(spec.top)
    middle = None if spec.middle is None else verifiers.get(spec.middle)
    guard = None
    if spec.guard is not None:
        from quasar.decoding.confidence_guard import ConfidenceGuard, guard_model

        guard = ConfidenceGuard(guard_model(verifiers.model, target), spec.guard)
    decoder = build_decoder(spec, target, options, middle, guard)
    return Engine(target, decoder, max_context=max_context, path=engine_path(target, middle))


def drafter_options(spec: EngineSpec, options: DrafterOptions) -> DrafterOptions:
    """options with model:PATH's model resolved (the drafter's own ModelSource)."""
    name, _, arg = spec.drafter.partition(":")
    return replace(options, draft_model=model_source(arg)) if name == "model" else options


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
        return Speculative(build_drafter(spec.drafter, target, options), spec.k, guard, width=spec.tree)
    from quasar.decoding.cascade import CascadeDrafter

    inner = build_drafter(spec.drafter, middle, options)
    return Speculative(CascadeDrafter(middle.model, inner, spec.k), AUTO)


def engine_path(target: LoadedModel, middle: LoadedModel | None = None) -> str:
    """The kernel paths that compute an engine's outputs, as reports print them beside their figures: the model's
    plan ('kernels:dpbusd', 'torch', ...), or a cascade's 'MIDDLE > TOP'."""
    top = target.model.plan.paths
    return top if middle is None else f"{middle.model.plan.paths} > {top}"
