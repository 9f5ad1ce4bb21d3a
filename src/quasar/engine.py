"""Engine: prompt -> token stream -> text pieces, with timing. Plain or speculative decoding plugs in
as a `Decoder`; the CLI, the Python API, the server and the bench all go through here."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from quasar.detokenize import IncrementalDetokenizer
from quasar.generate import StopRule, autoregressive
from quasar.kv_cache import KVCache
from quasar.loading import LoadedModel
from quasar.models.llama import Transformer
from quasar.outputs import RequestOutput
from quasar.prompt import Messages, encode
from quasar.sampling import SamplingParams
from quasar.stats import GenerationStats

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
    ) -> Iterator[list[int]]: ...


class Run:
    """One request in flight: iterate it for text pieces; `output` holds the result so far.

    Closing the iterator early (a client that went away) stops generation at once."""

    def __init__(self, output: RequestOutput, pieces: Callable[[RequestOutput], Iterator[str]]) -> None:
        self.output = output
        self._pieces = pieces(output)

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def close(self) -> None:
        self._pieces.close()

    def result(self) -> RequestOutput:
        for _ in self._pieces:
            pass
        return self.output


class Engine:
    """A loaded target (verifier) model plus a decoder; reuses one KV cache across requests."""

    def __init__(
        self,
        target: LoadedModel,
        decoder: Decoder = autoregressive,
        max_context: int | None = None,
        cache_slack: int = 16,
    ) -> None:
        self.target = target
        self.decoder = decoder
        limit = target.model.config.max_position_embeddings
        if max_context is not None and max_context < 1:
            raise ValueError(f"max_context must be a positive number of tokens, got {max_context}")
        self.max_context = min(max_context or limit, limit)
        self.cache_slack = cache_slack  # room past the last token for a verify step's draft
        self.cache: KVCache | None = None

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    def encode(self, prompt: str | Messages, chat: bool | None = None) -> list[int]:
        """Text or chat messages -> prompt token ids (`quasar.prompt.encode`: chat=None uses the chat
        template when there is one)."""
        return encode(self.tokenizer, prompt, chat)

    def fresh_cache(self, needed: int) -> KVCache:
        """An empty cache of `needed` positions rounded up to a multiple of CACHE_BUCKET. Its size is a
        function of the request alone: decode and verify steps attend over the whole buffer, so plain and
        speculative runs of the same request must get caches of the same size to round identically."""
        size = -(-needed // CACHE_BUCKET) * CACHE_BUCKET
        if self.cache is None or self.cache.max_len != size:
            self.cache = self.target.model.new_cache(size)
        self.cache.reset()
        return self.cache

    def run(self, prompt_ids: list[int], params: SamplingParams, prompt: str | Messages | None = None) -> Run:
        """Start a request (`prompt`, when given, is what `prompt_ids` were encoded from; it is only
        reported); nothing is computed until the Run is iterated."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens; the context window holds {self.max_context}"
            )
        budget = min(params.max_new_tokens, room)
        cache_len = min(len(prompt_ids) + budget + self.cache_slack, self.max_context + self.cache_slack)

        def pieces(output: RequestOutput) -> Iterator[str]:
            stats = output.stats
            stats.prompt_tokens = len(prompt_ids)
            detok = IncrementalDetokenizer(self.tokenizer, params.stop)
            start = time.perf_counter()
            cache = self.fresh_cache(cache_len)
            stream = self.decoder(self.target.model, cache, prompt_ids, params, StopRule(params, self.eos, budget), stats)
            try:
                for tokens in stream:
                    output.token_ids.extend(tokens)
                    piece = detok.add(tokens)
                    if piece:
                        yield piece
                    if detok.done:
                        stats.finish_reason = "stop"
                        break
                tail = detok.finish()
                if tail:
                    yield tail
            finally:
                stream.close()
                stats.new_tokens = len(output.token_ids)
                stats.decode_s = time.perf_counter() - start - stats.prefill_s
                output.text = detok.text

        return Run(RequestOutput(prompt, list(prompt_ids)), pieces)

    @property
    def eos(self) -> tuple[int, ...]:
        return self.target.eos_token_ids

    def generate(self, prompt_ids: list[int], params: SamplingParams, prompt: str | Messages | None = None
                 ) -> RequestOutput:
        return self.run(prompt_ids, params, prompt).result()
