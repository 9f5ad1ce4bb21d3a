"""One request in flight, and all of its state: its decoder's steps, its KV cache, its output, the text pieces not
yet taken, and how it ended (done, failed with `error`, or `cancelled`).

A request only asks for forwards; a quasar.decoding.batch.Batch runs them, several requests' at once or one alone
(Engine.run), and the request gets the same tokens either way.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

import torch

from quasar.decoding.autoregressive import Steps, StopRule
from quasar.decoding.detokenize import IncrementalDetokenizer
from quasar.decoding.outputs import RequestOutput
from quasar.decoding.processors import Processing, TokenLogprob
from quasar.decoding.prompt import Messages
from quasar.decoding.sampling import SamplingParams
from quasar.decoding.stats import GenerationStats
from quasar.decoding.step import Step
from quasar.model.kv_cache import CachePool, KVCache
from quasar.model.llama import Transformer
from quasar.model.loading import LoadedModel


class Decoder(Protocol):
    def __call__(
        self,
        model: Transformer,
        cache: KVCache,
        prompt_ids: list[int],
        params: SamplingParams,
        stop: StopRule,
        stats: GenerationStats,
        processing: Processing | None = None,  # the request's row processors (None: it has none)
    ) -> Steps: ...


class Host(Protocol):
    """What a request and a batch use of the engine they run on (quasar.decoding.engine.Engine)."""

    target: LoadedModel
    decoder: Decoder
    caches: CachePool

    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos(self) -> tuple[int, ...]: ...


class Budget(NamedTuple):
    """What one request may use (Engine.budget): `new_tokens` to generate, at most `room` (what the context window
    holds past its prompt), in a KV cache of `cache_len` positions."""

    new_tokens: int
    cache_len: int
    room: int


class Request:
    """One request in flight (see the module doc). `begin(cache)` starts the decoder; then, while `step` is not None,
    run that forward and `advance(logits)`; `finish()` ends it at any point.

    Its outcome: `finished` once it ended; `error`, what made it fail (None otherwise); `cancelled`, set by whoever
    stopped it before its end. `cancelled` is a plain bool rather than a threading.Event: the server's scheduler sets
    it on an HTTP thread under its own lock, and the batch reads it on the worker thread between steps; the write is
    one attribute store, whole under the GIL, and a step that reads it just before the store sees it at the next."""

    def __init__(self, engine: Host, prompt_ids: list[int], params: SamplingParams, budget: Budget,
                 processing: Processing | None = None, prompt: str | Messages | None = None) -> None:
        """`processing`: the request's row processors (Engine.processing; None: it has none); `prompt`: what
        `prompt_ids` were encoded from, only reported."""
        self.engine, self.params = engine, params
        self.budget, self.cache_len = budget.new_tokens, budget.cache_len
        self.output = RequestOutput(prompt, list(prompt_ids))
        self.processing = processing
        self.cache: KVCache | None = None
        self.step: Step | None = None  # the forward the decoder waits for
        self.pieces: list[str] = []  # text generated and not yet taken
        self.logprobs_taken = 0
        self.finished = False
        self.error: BaseException | None = None
        self.cancelled = False

    def begin(self, cache: KVCache) -> None:
        self.cache = cache
        self.started = time.perf_counter()
        stats = self.output.stats
        stats.prompt_tokens = len(self.output.prompt_token_ids)
        stats.cached_tokens = cache.length  # the start of the prompt the cache pool's kept cache held
        self.detok = IncrementalDetokenizer(self.engine.tokenizer, self.params.stop)
        stop = StopRule(self.params, self.engine.eos, self.budget)
        self.steps = self.engine.decoder(self.engine.target.model, cache, self.output.prompt_token_ids, self.params,
                                         stop, stats, processing=self.processing)
        self.advance(None)

    @torch.inference_mode()
    def advance(self, logits: torch.Tensor | None) -> None:
        """Hand the decoder its last step's logits; run it to its next forward (or to its end)."""
        try:
            item = self.steps.send(logits)
            while not isinstance(item, Step):
                self.emit(item)
                if self.finished:
                    return
                item = next(self.steps)
            self.step = item
        except StopIteration:
            self.finish()
        except BaseException:
            self.finish()
            raise

    def emit(self, tokens: list[int]) -> None:
        """A step's new tokens. With stop strings they go in one at a time, so that the output ends with the token
        that completed a stop string: the draft tokens a verify step accepted past it are not part of the answer
        (nor of its token count)."""
        if self.processing is not None:
            self.processing.commit(tokens)
        for part in ([t] for t in tokens) if self.detok.stop else (tokens,):
            self.output.token_ids.extend(part)
            piece = self.detok.add(part[:-1] if part and part[-1] in self.params.stop_token_ids else part)
            if piece:
                self.pieces.append(piece)
            if self.detok.done:
                self.output.stats.finish_reason = "stop"
                self.finish()
                return

    def take(self) -> list[str]:
        pieces, self.pieces = self.pieces, []
        return pieces

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the output's tokens not taken yet (none unless the params ask for logprobs)."""
        if self.processing is None or self.params.logprobs is None:
            return []
        taken, self.logprobs_taken = self.logprobs_taken, len(self.output.token_ids)
        return self.processing.logprobs[taken : self.logprobs_taken]

    def finish(self) -> None:
        """Stop generating (done, failed or cancelled): close the decoder, settle text and stats."""
        if self.finished:
            return
        self.finished, self.step = True, None
        if self.cache is None:  # never began
            return
        self.steps.close()
        tail = self.detok.finish()
        if tail:
            self.pieces.append(tail)
        stats = self.output.stats
        stats.new_tokens = len(self.output.token_ids)
        stats.decode_s = time.perf_counter() - self.started - stats.prefill_s
        self.output.text = self.detok.text
        if self.processing is not None and self.params.logprobs is not None:
            self.output.logprobs = self.processing.logprobs[: len(self.output.token_ids)]
