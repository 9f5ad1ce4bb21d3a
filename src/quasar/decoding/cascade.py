"""The cascade ('w8a8+bf16'): the float verifier's exact output at close to int8 cost.

Three levels. A cheap drafter (n-gram, ...) proposes; the W8A8 model verifies those proposals as in plain
speculative decoding; the tokens the W8A8 level emits form a block that the float verifier (the engine's
model) checks in one forward (quasar.decoding.speculative with this drafter); both levels take the same step (speculative.verify_step). The W8A8 model agrees with the float
model on about 95% of tokens, so float blocks are long while the float model runs about once per block.

The output is the float verifier's: at T = 0 its greedy output token for token; at T > 0 the W8A8 level's
tokens are distributed as the W8A8 model's (its own rejection sampling is lossless) and pass the W8A8
distributions as the draft distribution, so the float level's rejection sampling keeps the output
distributed as the float verifier's (two-level rejection sampling).

The middle level commits each block's tokens to its own drafter so it can draft past them, then rewinds them
when the float level decides; its KV cache follows the committed stream (kv_cache.StreamCache).
"""

from __future__ import annotations

import time

import torch

from quasar.decoding.drafters.base import Draft, Drafter
from quasar.model.kv_cache import StreamCache
from quasar.model.llama import FIXED_ROWS, Transformer
from quasar.decoding.sampling import Sampler, SamplingParams
from quasar.decoding.speculative import AUTO, DraftLength, verify_step
from quasar.decoding.step import run_alone
from quasar.decoding.stats import GenerationStats
from quasar.decoding.rejection import DenseDraft


class CascadeDrafter:
    free = False  # (Drafter): its proposals run the middle model

    def __init__(self, model: Transformer, inner: Drafter | None, k: int | str = AUTO, initial_len: int = 1024) -> None:
        self.model = model  # the middle level (W8A8)
        self.inner = inner  # the bottom level; None drafts nothing (the middle level decodes plainly)
        self.k = k
        self.stream = StreamCache(model, initial_len)
        self.tokens: list[int] = []  # the committed stream
        self.reset()

    def spawn(self) -> CascadeDrafter:
        return CascadeDrafter(self.model, self.inner.spawn() if self.inner else None, self.k, self.stream.initial_len)

    def reset(self) -> None:
        self.tokens = []
        self.provisional = 0  # tokens of the current block committed to the inner drafter
        self.carry: tuple[list[int], list[torch.Tensor]] = ([], [])  # the middle level's tokens past the last block
        self.carried_after = 0  # the length of the block the carry follows
        self.length = DraftLength(self.k)
        self.sampler: Sampler | None = None
        self.stats = GenerationStats()  # the middle level's verify steps
        if self.inner is not None:
            self.inner.reset()

    def commit(self, tokens: list[int]) -> None:
        if self.inner is not None:
            self.inner.rewind(self.provisional)
            self.inner.commit(tokens)
        self.provisional = 0
        self.tokens.extend(tokens)
        self.keep_carry(tokens)

    def keep_carry(self, committed: list[int]) -> None:
        """The middle level often emits past the block it was asked for. When the top level accepted the whole
        block and its bonus token is the first carried token, the rest of the carry continues the committed
        stream (drawn from the middle level's distribution given exactly this context), so the next block starts
        with it; otherwise it is dropped."""
        tokens, rows = self.carry
        self.carry = ([], [])
        if tokens and len(committed) == self.carried_after + 1 and committed[-1] == tokens[0]:
            self.carry = (tokens[1:], rows[1:])

    def rewind(self, n: int) -> None:
        if self.inner is not None:
            self.inner.rewind(self.provisional + n)
        self.provisional = 0
        self.carry = ([], [])
        del self.tokens[len(self.tokens) - n :]

    @torch.inference_mode()
    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        """Up to k tokens of the middle level's own speculative decoding, continuing the committed stream."""
        if k <= 0:
            return Draft([])
        if self.sampler is None or self.sampler.params != params:
            self.sampler = Sampler(params, self.model.plan)
        cache = self.stream.ready(len(self.tokens) + k + FIXED_ROWS)
        block, rows = list(self.carry[0]), list(self.carry[1])  # rows: the middle level's distributions [V]
        while len(block) < k:
            start = time.perf_counter()
            feed = self.stream.follow(self.tokens + block, most=FIXED_ROWS)  # a prompt is prefilled there
            self.stats.prefill_s += time.perf_counter() - start
            n = min(self.length.k, FIXED_ROWS - len(feed)) if self.inner else 0  # tokens past k are carried
            draft, verdict, target = run_alone(self.model, verify_step(
                lambda m: self.draft(block, m, params, generator) if m > 0 else Draft([]), n, feed, cache, params,
                self.sampler, generator, self.length, self.stats))
            self.stream.fed([*feed, *draft.tokens])
            if target is not None:  # sampling: each block token's distribution goes on as the draft's
                rows += [target.probs(i) for i in range(verdict.accepted + 1)]
            self.stream.trim(len(draft) - verdict.accepted)
            block += [*draft.tokens[: verdict.accepted], verdict.token]
            self.stats.record_step(len(draft), verdict.accepted, verdict.accepted + 1)
        self.carry, self.carried_after = (block[k:], rows[k:]), k
        return Draft(block[:k], None if params.greedy else DenseDraft(torch.stack(rows[:k])))

    def draft(self, block: list[int], n: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        """The bottom level's proposal after the committed stream and this block so far."""
        assert self.inner is not None
        self.inner.commit(block[self.provisional :])
        self.provisional = len(block)
        return self.inner.propose(n, params, generator)
