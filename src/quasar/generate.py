"""Prefill and the autoregressive decode loop: the baseline every speculative method is measured against."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from quasar.kv_cache import KVCache
from quasar.models.llama import Transformer
from quasar.sampling import Sampler, SamplingParams
from quasar.stats import GenerationStats


@torch.inference_mode()
def prefill(model: Transformer, cache: KVCache, prompt_ids: list[int]) -> torch.Tensor:
    """Run the prompt through the model; return the last position's logits [V]."""
    ids = torch.tensor([prompt_ids], device=model.device)  # [1, T]
    return model(ids, cache, last_only=True)[0, -1]


class StopRule:
    """When a token stream ends: EOS (unless ignored) or the token budget."""

    def __init__(self, params: SamplingParams, eos_ids: tuple[int, ...], budget: int) -> None:
        self.eos = frozenset(() if params.ignore_eos else eos_ids)
        self.budget = budget
        self.emitted = 0

    def cut(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Keep the tokens that may be emitted; say why the stream ends, or None to go on."""
        tokens = tokens[: self.budget - self.emitted]
        for i, token in enumerate(tokens):
            if token in self.eos:
                self.emitted += i + 1
                return tokens[: i + 1], "stop"
        self.emitted += len(tokens)
        return tokens, ("length" if self.emitted >= self.budget else None)


@torch.inference_mode()
def autoregressive(
    model: Transformer,
    cache: KVCache,
    prompt_ids: list[int],
    params: SamplingParams,
    stop: StopRule,
    stats: GenerationStats,
) -> Iterator[list[int]]:
    """Plain decoding: yields one-token lists; every decode forward is a verify step with no draft."""
    sampler = Sampler(params)
    start = time.perf_counter()
    token = sampler.next_token(prefill(model, cache, prompt_ids))
    stats.prefill_s = time.perf_counter() - start
    while True:
        tokens, reason = stop.cut([token])
        yield tokens
        if reason:
            stats.finish_reason = reason
            return
        start = time.perf_counter()
        logits = model(torch.tensor([[token]], device=model.device), cache)[0, -1]  # [V]
        token = sampler.next_token(logits)
        stats.verify_s += time.perf_counter() - start
        stats.record_step(proposed=0, accepted=0, emitted=1)
