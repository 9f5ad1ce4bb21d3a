"""Grammar drafting: a structured answer's forced tokens drafted for free.

Where a grammar allows only one text next (a JSON key, its quotes and colon, the rest of an enum value), llguidance
names the tokens of that text: they go into the draft without asking the drafter, and the drafter continues after
them. Its tokens are then cut at the first one the grammar rejects, and the grammar's forced tokens after them join
the draft, while room is left. The verifier still judges every token (each row masked by the grammar,
quasar.decoding.grammar), so the output is the one plain constrained decoding gives; a forced token is a draft
token that is nearly always accepted.

Cutting is exact only for a deterministic draft (a function of the tokens so far: n-gram, suffix).
A sampled draft (a model drafter at T > 0) is kept whole after the forced tokens: rejection sampling turns a
token the grammar rejects down (its target probability is 0) and draws from the residual, as it must; removing it
would bias the output toward the tokens such a draft proposes less often.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quasar.decoding.drafters.base import Draft, Drafter
from quasar.decoding.grammar import GrammarMask
from quasar.decoding.rejection import DraftProbs, OneHotDraft
from quasar.decoding.sampling import SamplingParams


@dataclass(frozen=True)
class AfterForced:
    """A sampled draft's distributions behind `forced` tokens (one-hot at those positions)."""

    forced: list[int]
    rest: DraftProbs

    def prob(self, i: int, token: int) -> float:
        n = len(self.forced)
        return OneHotDraft(self.forced).prob(i, token) if i < n else self.rest.prob(i - n, token)

    def subtract(self, i: int, weights: torch.Tensor, total: float) -> None:
        n = len(self.forced)
        if i < n:
            OneHotDraft(self.forced).subtract(i, weights, total)
        else:
            self.rest.subtract(i - n, weights, total)


def forced_draft(
    grammar: GrammarMask,
    drafter: Drafter | None,
    k: int,
    limit: int,
    params: SamplingParams,
    generator: torch.Generator,
) -> Draft:
    """A draft of the grammar's forced tokens (up to `limit`, the room left: forced tokens are nearly certain) and
    the drafter's continuation of them (up to k tokens in all; see the module doc for where it is cut)."""
    tokens: list[int] = []
    forced: list[int] = []  # positions in tokens
    while len(tokens) < limit:
        more = grammar.forced(tokens)[: limit - len(tokens)]
        forced += range(len(tokens), len(tokens) + len(more))
        tokens += more
        if drafter is None or len(tokens) >= k:
            break
        drafter.commit(tokens)
        draft = drafter.propose(k - len(tokens), params, generator)
        drafter.rewind(len(tokens))
        if draft.probs is not None:  # sampled: kept whole, behind the forced tokens
            probs = AfterForced(tokens, draft.probs) if tokens else draft.probs
            return Draft(tokens + draft.tokens, probs, tuple(forced))
        valid = grammar.accepted(draft.tokens, tokens)
        tokens += draft.tokens[:valid]
        if valid < len(draft.tokens) or not draft.tokens:
            break
    return Draft(tokens, None, tuple(forced))
