"""Prefill and the autoregressive decode loop: the baseline every speculative method is measured against.

A decoder (this loop, or quasar.decoding.speculative's) is a generator of `Steps`: it yields a `Step` when it needs the
target model's forward and is sent that step's logits back; it yields a list of token ids when they are
final. A quasar.decoding.batch.Batch drives it: it runs the forward of one request alone (Engine.run) or of
several requests' steps together, which gives every request bitwise the logits it gets alone.
"""

from __future__ import annotations

import time
from collections.abc import Generator

import torch

from quasar.model.kv_cache import KVCache
from quasar.decoding.step import Step
from quasar.model.llama import Transformer
from quasar.decoding.processors import Processing
from quasar.decoding.sampling import Sampler, SamplingParams
from quasar.decoding.stats import GenerationStats

Steps = Generator[Step | list[int], torch.Tensor | None, None]  # yields forwards and tokens; gets logits back


@torch.inference_mode()
def prefill(model: Transformer, cache: KVCache, prompt_ids: list[int]) -> torch.Tensor:
    """Run the prompt through the model; return the last position's logits [V]."""
    ids = torch.tensor([prompt_ids], device=model.device)  # [1, T]
    return model(ids, cache, last_only=True)[0, -1]


class StopRule:
    """When a token stream ends: EOS (unless ignored), a stop token id, or the token budget."""

    def __init__(self, params: SamplingParams, eos_ids: tuple[int, ...], budget: int) -> None:
        self.eos = frozenset((() if params.ignore_eos else eos_ids) + params.stop_token_ids)
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


def autoregressive(
    model: Transformer,
    cache: KVCache,
    prompt_ids: list[int],
    params: SamplingParams,
    stop: StopRule,
    stats: GenerationStats,
    processing: Processing | None = None,
) -> Steps:
    """Plain decoding: asks for the prompt's forward, then one forward per token; yields one-token lists. Each row
    passes through the request's processors (`processing`) before its token is picked."""
    sampler = Sampler(params, model.plan, processing)
    start = time.perf_counter()
    logits = yield Step(prompt_ids[cache.length :], cache, last_only=True)  # a kept start of it is not run again
    token = sampler.next_token(logits[-1])
    stats.prefill_s = time.perf_counter() - start
    while True:
        tokens, reason = stop.cut([token])
        yield tokens
        if reason:
            stats.finish_reason = reason
            return
        start = time.perf_counter()
        logits = yield Step([token], cache)
        token = sampler.next_token(logits[-1])
        stats.verify_s += time.perf_counter() - start
        stats.record_step(proposed=0, accepted=0, emitted=1)
