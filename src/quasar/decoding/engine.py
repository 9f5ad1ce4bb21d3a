"""Engine: prompt -> token stream -> text pieces, with timing. Plain or speculative decoding plugs in
as a `Decoder`; the CLI, the Python API, the server and the bench all go through here, one request at a
time (`run`) or several sharing each forward (quasar.decoding.batch)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from quasar.decoding.detokenize import IncrementalDetokenizer
from quasar.decoding.autoregressive import Steps, StopRule, autoregressive
from quasar.model.kv_cache import CachePool, KVCache
from quasar.model.loading import LoadedModel
from quasar.decoding.step import Step, run_steps
from quasar.model.llama import Transformer
from quasar.decoding.outputs import RequestOutput
from quasar.decoding.processors import Processing, TokenLogprob, Vocab, processors_for
from quasar.decoding.prompt import Messages, encode
from quasar.decoding.sampling import SamplingParams
from quasar.decoding.stats import GenerationStats

CACHE_BUCKET = 256  # KV cache sizes are multiples of this


class PromptTooLongError(ValueError):
    """The prompt does not leave room for one new token in the context window."""


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


class Request:
    """One request in flight: its decoder's steps, its KV cache, its output and the text pieces not yet taken.

    `begin(cache)` starts the decoder; then, while `step` is not None, run that forward and `advance(logits)`.
    Whoever runs the forwards (Engine.run alone, quasar.decoding.batch with others) gets the same tokens."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, budget: int, cache_len: int,
                 prompt: str | Messages | None = None) -> None:
        self.engine, self.params, self.budget, self.cache_len = engine, params, budget, cache_len
        self.output = RequestOutput(prompt, list(prompt_ids))
        self.cache: KVCache | None = None
        self.step: Step | None = None  # the forward the decoder waits for
        self.pieces: list[str] = []  # text generated and not yet taken
        self.finished = False
        self.processing = engine.processing(self.output.prompt_token_ids, params)  # its row processors, or None
        self.logprobs_taken = 0

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
        """Stop generating (done, or the client went away): close the decoder, settle text and stats."""
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


class Run:
    """One request in flight: iterate it for text pieces; `output` holds the result so far.

    Closing the iterator early (a client that went away) stops generation at once."""

    def __init__(self, output: RequestOutput, pieces: Iterator[str]) -> None:
        self.output = output
        self._pieces = pieces

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def close(self) -> None:
        self._pieces.close()

    def result(self) -> RequestOutput:
        for _ in self._pieces:
            pass
        return self.output


class Engine:
    """A loaded target (verifier) model plus a decoder; keeps the KV caches of finished requests for the next."""

    def __init__(
        self,
        target: LoadedModel,
        decoder: Decoder = autoregressive,
        max_context: int | None = None,
        cache_slack: int = 16,
        path: str | None = None,
    ) -> None:
        self.target = target
        self.decoder = decoder
        self.path = path or target.model.plan.paths  # what computes the outputs (a cascade: both levels, builder.engine_path)
        limit = target.model.config.max_position_embeddings
        if max_context is not None and max_context < 1:
            raise ValueError(f"max_context must be a positive number of tokens, got {max_context}")
        self.max_context = min(max_context or limit, limit)
        self.cache_slack = cache_slack  # room past the last token for a verify step's draft
        self.caches = CachePool(target.model)  # the requests' KV caches (a batch may set a budget)

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    def encode(self, prompt: str | Messages, chat: bool | None = None, special: bool = False) -> list[int]:
        """Text or chat messages -> prompt token ids (`quasar.decoding.prompt.encode`: chat=None uses the chat
        template when there is one; special: control tokens written in the text count as control tokens)."""
        return encode(self.tokenizer, prompt, chat, special)

    def fresh_cache(self, needed: int) -> KVCache:
        """An empty cache of `needed` positions rounded up to a multiple of CACHE_BUCKET, for one forward outside
        any request (an eval's prefill), valid until the next request starts; requests take theirs from `caches`."""
        cache = self.caches.take(-(-needed // CACHE_BUCKET) * CACHE_BUCKET)
        self.caches.give(cache)
        return cache

    def request(self, prompt_ids: list[int], params: SamplingParams, prompt: str | Messages | None = None) -> Request:
        """A request checked against the context window, not started (`prompt`, when given, is what
        `prompt_ids` were encoded from; it is only reported)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens; the context window holds {self.max_context}"
            )
        budget = min(params.max_new_tokens, room)
        needed = min(len(prompt_ids) + budget + self.cache_slack, self.max_context + self.cache_slack)
        # A cache's size is a function of the request alone: on the torch path decode and verify steps attend
        # over the whole buffer, so plain and speculative runs of a request must get caches of one size.
        return Request(self, prompt_ids, params, budget, -(-needed // CACHE_BUCKET) * CACHE_BUCKET, prompt)

    def run(self, prompt_ids: list[int], params: SamplingParams, prompt: str | Messages | None = None) -> Run:
        """Start a request alone; nothing is computed until the Run is iterated (quasar.decoding.batch runs several
        at once, with the same results)."""
        request = self.request(prompt_ids, params, prompt)

        def pieces() -> Iterator[str]:
            cache = self.caches.take(request.cache_len, request.output.prompt_token_ids)
            try:
                request.begin(cache)
                while True:
                    yield from request.take()
                    if request.step is None:
                        return
                    with torch.inference_mode():
                        logits = run_steps(self.target.model, [request.step])[0]
                    request.advance(logits)
            finally:
                request.finish()
                self.caches.give(cache)

        return Run(request.output, pieces())

    @property
    def eos(self) -> tuple[int, ...]:
        return self.target.eos_token_ids

    @property
    def vocab(self) -> Vocab:
        return Vocab(self.target.model.config.vocab_size, self.eos, self.tokenizer)

    def processing(self, prompt_ids: list[int], params: SamplingParams) -> Processing | None:
        """The row processors `params` asks for over this prompt (quasar.decoding.processors); None when none."""
        processors = processors_for(params, self.vocab)
        if not processors and params.logprobs is None:
            return None
        return Processing(processors, prompt_ids, params.logprobs)

    def generate(self, prompt_ids: list[int], params: SamplingParams, prompt: str | Messages | None = None
                 ) -> RequestOutput:
        return self.run(prompt_ids, params, prompt).result()
