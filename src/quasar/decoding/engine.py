"""Engine: prompt -> token stream -> text pieces, with timing. Plain or speculative decoding plugs in as a
`Decoder`; the CLI, the Python API, the server and the bench all go through here.

The engine makes requests (`request`: its token budget and KV cache size come from `budget`, the one place that
computes them) and a quasar.decoding.batch.Batch runs them: several sharing each forward, or one alone (`run`, a
batch of one, with the same tokens)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from quasar.decoding.autoregressive import autoregressive
from quasar.decoding.batch import Batch
from quasar.decoding.outputs import RequestOutput
from quasar.decoding.processors import Processing, Vocab, processors_for
from quasar.decoding.prompt import Messages, encode
from quasar.decoding.request import Budget, Decoder, Request
from quasar.decoding.sampling import SamplingParams
from quasar.model.kv_cache import CachePool, KVCache
from quasar.model.loading import LoadedModel

CACHE_BUCKET = 256  # KV cache sizes are multiples of this


class PromptTooLongError(ValueError):
    """The prompt does not leave room for one new token in the context window."""


class KVBudgetError(PromptTooLongError):
    """The prompt leaves no room for one new token in a cache within the KV budget."""


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

    def budget(self, prompt_tokens: int, max_new_tokens: int | None = None, kv_budget: int | None = None) -> Budget:
        """What a request with a prompt of this many tokens may use: `max_new_tokens`, at most what the context
        window holds past the prompt (`room`); None: all of that room, and no more than a cache within `kv_budget`
        positions holds. Its cache holds the prompt, the answer and `cache_slack`, rounded up to CACHE_BUCKET.
        Raises PromptTooLongError when not one new token fits (KVBudgetError: not within `kv_budget`)."""
        room = self.max_context - prompt_tokens
        if room < 1:
            raise PromptTooLongError(
                f"the prompt has {prompt_tokens} tokens; the context window holds {self.max_context}"
            )
        new_tokens = room if max_new_tokens is None else min(max_new_tokens, room)
        if max_new_tokens is None and kv_budget is not None:
            new_tokens = min(new_tokens, kv_budget // CACHE_BUCKET * CACHE_BUCKET - self.cache_slack - prompt_tokens)
            if new_tokens < 1:
                raise KVBudgetError(f"the prompt's {prompt_tokens} tokens leave no room in a KV budget of {kv_budget} "
                                    "positions")
        # A cache's size is a function of the request alone: on the torch path decode and verify steps attend
        # over the whole buffer, so plain and speculative runs of a request must get caches of one size.
        cache_len = -(-(prompt_tokens + new_tokens + self.cache_slack) // CACHE_BUCKET) * CACHE_BUCKET
        return Budget(new_tokens, cache_len, room)

    def request(self, prompt_ids: list[int], params: SamplingParams, prompt: str | Messages | None = None) -> Request:
        """A request within its budget, not started (`prompt`, when given, is what `prompt_ids` were encoded from; it
        is only reported)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        budget = self.budget(len(prompt_ids), params.max_new_tokens)
        return Request(self, prompt_ids, params, budget, self.processing(prompt_ids, params), prompt)

    def run(self, prompt_ids: list[int], params: SamplingParams, prompt: str | Messages | None = None) -> Run:
        """Start a request alone: a batch of one, on the cache pool as it is. Nothing is computed until the Run is
        iterated; closing it early cancels the request and gives its cache back."""
        request = self.request(prompt_ids, params, prompt)

        def pieces() -> Iterator[str]:
            batch = Batch(self, max_batch=1, configure_pool=False)
            batch.add(request)
            try:
                while not batch.idle:
                    batch.step()
                    yield from request.take()
                if request.error is not None:
                    raise request.error
            finally:
                batch.cancel(request)  # nothing left to stop once it ended

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
