"""Rejection sampling for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A verify step scores `[last, *draft]` with the verifier, giving k + 1 target distributions. Then:

- an *accepted* token is a draft token kept: draft token i is accepted with probability
  min(1, target_probs[i, d_i] / draft_probs[i, d_i]), scanning left to right until the first rejection;
- a *recovered* token replaces the first rejected draft token: it is sampled from the normalised
  residual max(0, target_probs[i] - draft_probs[i]);
- a *bonus* token follows a fully accepted draft: it is sampled from target_probs[k].

Every step therefore emits accepted + 1 tokens, and they follow the target distribution exactly.
A deterministic drafter's draft (n-gram, suffix: draft_probs=None) is a one-hot draft distribution: its token is
accepted with probability target_probs[i, d_i] and the residual is the target with d_i removed. `matched_verdict`
gives it that law with the draws of plain decoding: each position's token is drawn from its target row with one
uniform number, as a plain step draws it, and a draft token is accepted iff it is that draw (P = target_probs[i,
d_i]; a rejection's draw follows the target without d_i). Each emitted token is then the very token plain decoding
draws from the same generator: a seeded request's output is the same whatever was drafted, and how long its drafts
are may follow measured costs and a busy batch's cuts. A model drafter's draft distributions come dense (`DenseDraft`, [k, V]).
Greedy decoding is the special case of one-hot target distributions (the argmax): a draft token is
accepted iff it equals the argmax, and the recovered or bonus token is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from quasar.decoding.sampling import TargetRows


@dataclass(frozen=True)
class Verdict:
    accepted: int  # leading draft tokens kept
    token: int  # the recovered token (accepted < k) or the bonus token (accepted == k)


class DraftProbs(Protocol):
    def prob(self, i: int, token: int) -> float:
        """draft_probs[i, token]."""

    def subtract(self, i: int, weights: torch.Tensor, total: float) -> None:
        """weights [V] (summing to total) <- max(0, weights - total * draft_probs[i]), in place."""


@dataclass(frozen=True)
class OneHotDraft:
    """A deterministic drafter's draft: all the mass on the drafted token."""

    tokens: list[int]

    def prob(self, i: int, token: int) -> float:
        return 1.0 if token == self.tokens[i] else 0.0

    def subtract(self, i: int, weights: torch.Tensor, total: float) -> None:
        weights[self.tokens[i]] = 0.0


@dataclass(frozen=True)
class DenseDraft:
    probs: torch.Tensor  # [k, V]

    def prob(self, i: int, token: int) -> float:
        return float(self.probs[i, token])

    def subtract(self, i: int, weights: torch.Tensor, total: float) -> None:
        weights.sub_(self.probs[i].to(weights.device), alpha=total).clamp_(min=0.0)


def rejection_sample(
    draft_tokens: list[int],  # k
    draft_probs: DraftProbs | None,  # None for a deterministic (one-hot) drafter
    target: TargetRows,  # k + 1 rows, after temperature / top-k / top-p / min-p
    generator: torch.Generator,
) -> Verdict:
    """Accept a prefix of the draft and pick the next token so the output follows the target rows."""
    k = len(draft_tokens)
    draft = OneHotDraft(draft_tokens) if draft_probs is None else draft_probs
    uniform = torch.rand(k, generator=generator).tolist()  # [k]
    for i, token in enumerate(draft_tokens):
        if not uniform[i] * draft.prob(i, token) < target.prob(i, token):  # u < min(1, target / draft)
            return Verdict(i, target.sample_residual(i, lambda w, total: draft.subtract(i, w, total), generator))
    return Verdict(k, target.sample(k, generator))


def matched_verdict(
    draft_tokens: list[int],  # k, deterministic
    target: TargetRows,  # k + 1 rows, after temperature / top-k / top-p / min-p
    generator: torch.Generator,  # one uniform number per emitted token, as plain decoding draws
) -> Verdict:
    """rejection_sample of a deterministic draft, drawn as plain decoding draws: the draft is accepted while each
    token equals its row's draw, and the first draw that differs (or the bonus draw) is the next token."""
    for i, token in enumerate(draft_tokens):
        drawn = target.sample(i, generator)
        if drawn != token:
            return Verdict(i, drawn)
    return Verdict(len(draft_tokens), target.sample(len(draft_tokens), generator))


def greedy_verdict(
    draft_tokens: list[int],  # k
    target_tokens: list[int],  # k + 1: the argmax of each target row
) -> Verdict:
    """rejection_sample at temperature 0 without building one-hot distributions or drawing random
    numbers: draft tokens are accepted while they equal the argmax, the next token is the argmax."""
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_tokens[accepted]:
        accepted += 1
    return Verdict(accepted, target_tokens[accepted])
