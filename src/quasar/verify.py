"""Rejection sampling for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A verify step scores `[last, *draft]` with the verifier, giving k + 1 target distributions. Then:

- an *accepted* token is a draft token kept: draft token i is accepted with probability
  min(1, target_probs[i, d_i] / draft_probs[i, d_i]), scanning left to right until the first rejection;
- a *recovered* token replaces the first rejected draft token: it is sampled from the normalised
  residual max(0, target_probs[i] - draft_probs[i]);
- a *bonus* token follows a fully accepted draft: it is sampled from target_probs[k].

Every step therefore emits accepted + 1 tokens, and they follow the target distribution exactly.
Deterministic drafters (n-gram, suffix) pass draft_probs=None: a one-hot draft distribution, so a
token is accepted with probability target_probs[i, d_i] and the residual is the target with d_i removed.
Greedy decoding is the special case of one-hot target distributions (the argmax): a draft token is
accepted iff it equals the argmax, and the recovered or bonus token is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quasar.sampling import sample


@dataclass(frozen=True)
class Verdict:
    accepted: int  # leading draft tokens kept
    token: int  # the recovered token (accepted < k) or the bonus token (accepted == k)


def rejection_sample(
    draft_tokens: torch.Tensor,  # [k] int64
    draft_probs: torch.Tensor | None,  # [k, V] float32, or None for a deterministic (one-hot) drafter
    target_probs: torch.Tensor,  # [k + 1, V] float32, after temperature / top-k / top-p
    generator: torch.Generator,
) -> Verdict:
    """Accept a prefix of the draft and pick the next token so the output follows target_probs."""
    k = draft_tokens.shape[0]
    rows = torch.arange(k)
    target_p = target_probs[rows, draft_tokens]  # [k]
    draft_p = torch.ones(k) if draft_probs is None else draft_probs[rows, draft_tokens]  # [k]
    uniform = torch.rand(k, generator=generator)  # [k]
    accept = uniform * draft_p < target_p  # [k]: u < min(1, target / draft)
    accepted = int(accept.to(torch.int64).cumprod(0).sum())
    if accepted == k:
        return Verdict(k, int(sample(target_probs[k], generator)))
    return Verdict(accepted, int(sample(residual(draft_tokens, draft_probs, target_probs, accepted), generator)))


def greedy_verdict(
    draft_tokens: torch.Tensor,  # [k] int64
    target_logits: torch.Tensor,  # [k + 1, V]
) -> Verdict:
    """rejection_sample at temperature 0 without building one-hot distributions or drawing random
    numbers: draft tokens are accepted while they equal the argmax, the next token is the argmax."""
    best = target_logits.argmax(-1)  # [k + 1]
    k = draft_tokens.shape[0]
    accepted = int((draft_tokens == best[:k]).to(torch.int64).cumprod(0).sum())
    return Verdict(accepted, int(best[accepted]))


def residual(
    draft_tokens: torch.Tensor,  # [k]
    draft_probs: torch.Tensor | None,  # [k, V] or None
    target_probs: torch.Tensor,  # [k + 1, V]
    i: int,
) -> torch.Tensor:
    """normalise(max(0, target_probs[i] - draft_probs[i])): [V]."""
    target = target_probs[i]  # [V]
    if draft_probs is None:
        rest = target.clone()
        rest[draft_tokens[i]] = 0.0
    else:
        rest = (target - draft_probs[i]).clamp_(min=0.0)
    total = rest.sum()
    # total is 0 only when target == draft, where rejection has probability 0 (rounding aside).
    return rest / total if total > 0 else target
