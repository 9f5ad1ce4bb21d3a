"""Several candidates for one position, verified so the token follows the target exactly (SpecInfer's multi-step
speculative sampling, Miao et al. 2024; SpecTr, Sun et al. 2023).

A drafter proposes c candidates t_1..t_c for one position (say, the children of one node of a draft tree), and the
verifier's row for that position gives the target distribution. The candidates are tried in order against a
residual r, which starts as the target row:

- candidate j is *accepted* with probability min(1, r(t_j) / draft_j(t_j)), and the position is decided;
- on its rejection r <- normalise(max(0, r - draft_j)), and candidate j + 1 is tried against that;
- a *recovered* token is drawn from the last residual once every candidate was rejected.

draft_j is the distribution candidate j was drawn from. A model drafter's candidates are drawn i.i.d. from its
draft_probs (repeats allowed): draft_j is draft_probs in every round. A deterministic drafter's candidates (an
n-gram index's continuations, most frequent first) are distinct tokens: draft_j is one-hot at t_j, so t_j is
accepted with probability r(t_j) and a rejection removes t_j from r and renormalises (sampling the target without
replacement).

Why it is exact: round j is single-candidate rejection sampling (quasar.decoding.rejection) of r with a candidate
drawn independently of the earlier rounds; it emits x with probability min(r(x), draft_j(x)) and otherwise, with
probability sum max(0, r - draft_j), passes on to later rounds that emit normalise(max(0, r - draft_j)) (by
induction from the last residual, which is sampled directly); min(r, q) + max(0, r - q) = r.

Greedy decoding (a one-hot target, the argmax) reduces to: the first candidate equal to the argmax if there is
one, else the argmax (`greedy_choice`, which draws no random numbers). Deterministic candidates reach the same law
by matching the row's one draw (`greedy_choice` of the draw): the draft tree's walk (quasar.decoding.tree) does
that, so its output is plain decoding's. `verify_candidates` is the rule for candidates drawn from a distribution;
no drafter samples tree candidates today, so the engine does not call it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quasar.decoding.rejection import DraftProbs, OneHotDraft
from quasar.decoding.sampling import TargetRows


@dataclass(frozen=True)
class Candidates:
    """The tokens proposed for one position, in the order they are tried. Checked when made: a deterministic
    draft's tokens must be distinct, a sampled draft's must have draft probability > 0 (ValueError)."""

    tokens: list[int]  # c (0: no candidates, the position's token is drawn from the target row)
    draft_probs: DraftProbs | None = None  # None: deterministic; else the tokens are i.i.d. draws from row draft_row
    draft_row: int = 0

    def __post_init__(self) -> None:
        if self.draft_probs is None and len(set(self.tokens)) < len(self.tokens):
            raise ValueError(f"a deterministic draft's candidates must be distinct, got {self.tokens}")
        for token in self.tokens if self.draft_probs is not None else ():
            if not self.draft_probs.prob(self.draft_row, token) > 0:
                raise ValueError(f"candidate {token} has draft probability 0 in row {self.draft_row}: "
                                 "a sampled draft's candidates must be drawn from its draft_probs")

    def round(self, j: int) -> tuple[DraftProbs, int]:
        """(the distribution candidate j was drawn from, its row): one-hot at tokens[j], or draft_probs' row."""
        if self.draft_probs is None:
            return OneHotDraft(self.tokens), j
        return self.draft_probs, self.draft_row


@dataclass(frozen=True)
class Choice:
    accepted: int | None  # the index of the accepted candidate; None when every candidate was rejected (or none came)
    token: int  # the accepted candidate, else the recovered token (with no candidates: a bonus token from the row)


def verify_candidates(
    candidates: Candidates,  # c tokens for the position of target row i
    target: TargetRows,  # after temperature / top-k / top-p / min-p; its residual buffer holds r
    i: int,
    generator: torch.Generator,  # the request's: c uniform numbers, then one draw if every candidate is rejected
) -> Choice:
    """Accept at most one candidate, else draw the recovered token, so the token follows target row i exactly."""
    tokens = candidates.tokens
    if not tokens:
        return Choice(None, target.sample(i, generator))
    uniform = torch.rand(len(tokens), generator=generator).tolist()  # [c]
    weights, total = target.row(i)
    residual = target.residual.copy_(weights)  # [V] r, as weights summing to total
    for j, token in enumerate(tokens):
        draft, row = candidates.round(j)
        if uniform[j] * draft.prob(row, token) < float(residual[token]) / total:  # u < min(1, r / draft)
            return Choice(j, token)
        draft.subtract(row, residual, total)  # r <- max(0, r - draft), normalised by the new total
        total = float(residual.sum(dtype=torch.float64))
        if not total > 0:  # r == draft: the rejection had probability 0 but for rounding; sample_left takes row i
            break
    return Choice(None, target.sample_left(i, residual, generator))


def greedy_choice(
    tokens: list[int],  # c candidates
    target_token: int,  # the position's token: its target row's argmax, or its draw
) -> Choice:
    """The first candidate equal to the position's token is accepted, else that token is the recovered one. With the
    row's argmax: verify_candidates at temperature 0. With the row's draw (as plain decoding draws it): a
    deterministic draft's candidates under verify_candidates' law, candidate j accepted with probability p(t_j)."""
    return Choice(tokens.index(target_token) if target_token in tokens else None, target_token)
