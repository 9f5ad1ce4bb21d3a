"""Drafters: cheap proposers of the next k tokens, behind one small protocol and a registry.

A drafter sees the committed token stream (prompt, then every token the verifier emitted) and
proposes a continuation. It never touches the verifier's KV cache; drafters with a model keep their own.

    drafter.reset()                       # a new request begins
    drafter.commit(tokens)                # these tokens are final (the prompt, then each step's output)
    draft = drafter.propose(k, params, generator)   # up to k tokens continuing the committed stream

Registry names: 'ngram', 'suffix', 'model:PATH', 'layerskip:N' (see build_drafter).
"""

from __future__ import annotations

from quasar.decoding.drafters.base import Draft, Drafter, DrafterOptions
from quasar.model.loading import LoadedModel
from quasar.registry import lookup
from quasar.spec import DRAFTER_FORMS, NO_DRAFTER

__all__ = ["Draft", "Drafter", "DrafterOptions", "build_drafter"]


# name -> "module:function" with build(arg: str | None, target: LoadedModel, options: DrafterOptions) -> Drafter
DRAFTERS: dict[str, str] = {
    "ngram": "quasar.decoding.drafters.ngram:build",
    "suffix": "quasar.decoding.drafters.suffix:build",
    "model": "quasar.decoding.drafters.model_drafter:build",
    "layerskip": "quasar.decoding.drafters.layerskip:build",
}


def build_drafter(spec: str, target: LoadedModel, options: DrafterOptions = DrafterOptions()) -> Drafter | None:
    """'none' -> None (plain decoding); 'ngram', 'suffix', 'model:PATH', 'layerskip:N' -> a Drafter."""
    if spec == NO_DRAFTER:
        return None
    name, _, arg = spec.partition(":")
    return lookup(DRAFTERS, name, "drafter", DRAFTER_FORMS)(arg or None, target, options)
