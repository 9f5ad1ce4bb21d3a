"""Drafters: cheap proposers of the next k tokens, behind one small protocol and a registry.

A drafter sees the committed token stream (prompt, then every token the verifier emitted) and
proposes a continuation. It never touches the verifier's KV cache; drafters with a model keep their own.

    drafter.reset()                       # a new request begins
    drafter.commit(tokens)                # these tokens are final (the prompt, then each step's output)
    draft = drafter.propose(k, params, generator)   # up to k tokens continuing the committed stream

Registry names: 'ngram', 'suffix', 'model:PATH', 'layerskip:N' (see build_drafter).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from quasar.loading import LoadedModel
from quasar.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    tokens: list[int]  # k proposed token ids (k may be 0)
    probs: torch.Tensor | None = None  # [k, V] the drafter's distributions; None for deterministic drafters

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    def reset(self) -> None: ...

    def commit(self, tokens: list[int]) -> None: ...

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft: ...


@dataclass(frozen=True)
class DrafterOptions:
    ngram_min: int = 1  # shortest suffix an n-gram drafter matches
    ngram_max: int = 3  # longest suffix an n-gram drafter matches (the paper: n in 1..3)
    cache_dir: str | Path | None = None  # for 'model:PATH' drafters loaded from GGUF

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")


# name -> module with build(arg: str | None, target: LoadedModel, options: DrafterOptions) -> Drafter
DRAFTERS: dict[str, str] = {
    "ngram": "quasar.drafters.ngram",
    "suffix": "quasar.drafters.suffix",
    "model": "quasar.drafters.model_drafter",
    "layerskip": "quasar.drafters.layerskip",
}
NO_DRAFTER = "none"


def build_drafter(spec: str, target: LoadedModel, options: DrafterOptions = DrafterOptions()) -> Drafter | None:
    """'none' -> None (plain decoding); 'ngram', 'suffix', 'model:PATH', 'layerskip:N' -> a Drafter."""
    if spec == NO_DRAFTER:
        return None
    name, _, arg = spec.partition(":")
    if name not in DRAFTERS:
        choices = ", ".join([NO_DRAFTER, "ngram", "suffix", "model:PATH", "layerskip:N"])
        raise ValueError(f"unknown drafter {spec!r}; choose from {choices}")
    return importlib.import_module(DRAFTERS[name]).build(arg or None, target, options)
