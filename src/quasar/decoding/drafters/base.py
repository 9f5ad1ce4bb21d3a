"""The drafter protocol: what a drafter is given and what it proposes (the registry is quasar.decoding.drafters)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from quasar.decoding.sampling import SamplingParams
from quasar.decoding.rejection import DraftProbs
from quasar.model.source import ModelSource


@dataclass(frozen=True)
class Draft:
    tokens: list[int]  # k proposed token ids (k may be 0)
    probs: DraftProbs | None = None  # the drafter's distributions (quasar.decoding.rejection); None for deterministic drafts
    forced: tuple[int, ...] = ()  # the positions of tokens a grammar forced (quasar.decoding.drafters.forced)

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    # proposing costs next to nothing (no model runs) and the drafts are deterministic (Draft.probs None, no random
    # number drawn: verified by matching plain decoding's draws when sampling): while drafting does not pay, a request
    # still asks for one token a step and compares it with the verifier's, so that it notices when drafting would
    # pay again
    free: bool

    def spawn(self) -> Drafter:
        """A drafter of the same kind for another request in flight at the same time (sharing what may be
        shared, such as a model's weights; never a token stream)."""

    def reset(self) -> None: ...

    def commit(self, tokens: list[int]) -> None: ...

    def rewind(self, n: int) -> None:
        """Forget the last n committed tokens (a cascade's middle level commits tokens the top may reject)."""

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft: ...


@dataclass(frozen=True)
class DrafterOptions:
    ngram_min: int = 1  # shortest suffix an n-gram drafter matches
    ngram_max: int = 3  # longest suffix an n-gram drafter matches (the paper: n in 1..3)
    draft_model: ModelSource | None = None  # model:PATH's model, resolved where the engine is built

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
