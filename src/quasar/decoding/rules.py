"""The per-request logit rules of SamplingParams as row processors (quasar.decoding.processors): a logit bias, the
minimum output length, and the presence / frequency / repetition penalties.

Each rule processes row i of a step as plain decoding processes the position after the tokens so far and draft[:i]:
the penalties count the generated tokens (and, for repetition, the prompt's) of history + draft[:i], min_tokens
counts the generated tokens before the row. Formulas (OpenAI's and vLLM's):
    logit -= frequency_penalty * count + presence_penalty * (count > 0)     over the generated tokens
    logit = logit / r if logit > 0 else logit * r                         r = repetition_penalty, prompt + generated
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from quasar.decoding.sampling import SamplingParams


@dataclass(frozen=True)
class Vocab:
    """What a processor may need to know of the verifier's vocabulary."""

    size: int  # V, the width of a logits row
    eos: tuple[int, ...] = ()  # the tokens that end a stream (the model's EOS ids)
    tokenizer: Any = None  # the model's Hugging Face tokenizer (None where a test has none)


class LogitBias:
    """Adds a fixed bias to some tokens' logits, at every position."""

    def __init__(self, bias: tuple[tuple[int, float], ...]) -> None:
        self.ids = torch.tensor([t for t, _ in bias])  # [n]
        self.values = torch.tensor([v for _, v in bias])  # [n]

    def apply(self, logits: torch.Tensor, history: Sequence[int], draft: Sequence[int]) -> None:
        logits[:, self.ids] += self.values

    def commit(self, tokens: Sequence[int]) -> None:
        pass


class MinTokens:
    """Bans the tokens that would end the output (`banned`) until `count` tokens are generated, but in a row where
    the processors before it allow nothing else (a grammar whose answer is whole): there the output may end."""

    def __init__(self, count: int, banned: tuple[int, ...]) -> None:
        self.count, self.banned = count, list(banned)
        self.generated = 0

    def apply(self, logits: torch.Tensor, history: Sequence[int], draft: Sequence[int]) -> None:
        rows = min(len(logits), self.count - self.generated)  # row i follows generated + i tokens
        if rows <= 0:
            return
        ends = logits[:rows, self.banned].clone()  # [rows, n]
        logits[:rows, self.banned] = -float("inf")
        for i in torch.isneginf(logits[:rows]).all(-1).nonzero()[:, 0].tolist():  # nothing else allowed
            logits[i, self.banned] = ends[i]

    def commit(self, tokens: Sequence[int]) -> None:
        self.generated += len(tokens)


class Penalties:
    """Presence, frequency and repetition penalties over the tokens generated so far (and the prompt's, for
    repetition): counts kept as the request commits tokens, each row adding the draft tokens before it."""

    def __init__(self, presence: float, frequency: float, repetition: float) -> None:
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        self.generated: Counter[int] = Counter()
        self.seen: set[int] | None = None  # prompt and generated tokens, from the history of the first row processed

    def apply(self, logits: torch.Tensor, history: Sequence[int], draft: Sequence[int]) -> None:
        if self.seen is None:
            self.seen = set(history)
        # [S + k] the tokens seen before the last row (a token listed twice gets the same value twice: harmless)
        seen = torch.tensor([*self.seen, *draft], dtype=torch.int64) if self.repetition != 1 else None
        counts = Counter(self.generated)
        for i in range(len(logits)):
            if i:
                counts[draft[i - 1]] += 1
            self.penalise(logits[i], None if seen is None else seen[: len(self.seen) + i], counts)

    def penalise(self, row: torch.Tensor, seen: torch.Tensor | None, counts: Counter[int]) -> None:
        """row [V] in place, given the tokens seen before it [S] (None: no repetition penalty) and the generated
        tokens' counts."""
        if seen is not None and len(seen):
            logits = row[seen]  # a copy
            row[seen] = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        if counts and (self.presence or self.frequency):
            ids = torch.tensor(list(counts), dtype=torch.int64)
            times = torch.tensor(list(counts.values()), dtype=row.dtype)
            row[ids] -= self.frequency * times + self.presence

    def commit(self, tokens: Sequence[int]) -> None:
        self.generated.update(tokens)
        if self.seen is not None:
            self.seen.update(tokens)


def logit_bias(params: SamplingParams, vocab: Vocab) -> LogitBias | None:
    if not params.logit_bias:
        return None
    too_large = [t for t, _ in params.logit_bias if t >= vocab.size]
    if too_large:
        raise ValueError(f"logit_bias names token {too_large[0]}; the vocabulary has {vocab.size} tokens")
    return LogitBias(params.logit_bias)


def min_tokens(params: SamplingParams, vocab: Vocab) -> MinTokens | None:
    banned = tuple(t for t in {*(() if params.ignore_eos else vocab.eos), *params.stop_token_ids} if t < vocab.size)
    return MinTokens(params.min_tokens, banned) if params.min_tokens and banned else None


def penalties(params: SamplingParams, vocab: Vocab) -> Penalties | None:
    if not (params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1):
        return None
    return Penalties(params.presence_penalty, params.frequency_penalty, params.repetition_penalty)
