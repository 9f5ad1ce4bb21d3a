"""The Python API, shaped like vLLM's offline `LLM`:

    from quasar import LLM, SamplingParams
    llm = LLM("default", verifier="w8a8", drafter="ngram", k=5)
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_new_tokens=32))
    print(outputs[0].text, outputs[0].stats.mean_accepted_tokens)

`generate` runs its prompts together in continuous batches (quasar.decoding.batch): up to `max_batch` of them share
each forward, and each gets the tokens it would get alone. One LLM is not thread-safe: for concurrent callers,
serve it (`quasar serve`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quasar.decoding.batch import Batch
from quasar.decoding.engine import Decoder, Engine
from quasar.decoding.autoregressive import autoregressive
from quasar.model.loading import LoadedModel
from quasar.model.llama import Transformer
from quasar.decoding.outputs import RequestOutput
from quasar.decoding.prompt import Messages
from quasar.decoding.sampling import SamplingParams
from quasar.verifiers.registry import load_verifier


@dataclass(frozen=True)
class DecodeConfig:
    """Which drafter proposes tokens and how many: drafter 'none' is plain autoregressive decoding."""

    drafter: str = "none"
    k: int | str = "auto"  # draft length, or 'auto' (adapts to recent acceptance; measured faster than 5 here)
    ngram_min: int = 1
    ngram_max: int = 3
    guard: float | None = None  # re-score positions whose top-1 logit margin is below this with bf16 (quasar.decoding.confidence_guard)


def cascade_levels(verifier: str) -> tuple[str | None, str]:
    """'w8a8+bf16' -> ('w8a8', 'bf16'): a cascade's middle level and the verifier whose output it gives;
    a plain name -> (None, name)."""
    levels = verifier.split("+")
    if len(levels) == 1:
        return None, verifier
    if len(levels) != 2 or not all(levels):
        raise ValueError(f"a cascade verifier is MIDDLE+TOP, e.g. 'w8a8+bf16', got {verifier!r}")
    return levels[0], levels[1]


def build_decoder(target: LoadedModel, config: DecodeConfig, cache_dir: str | Path | None = None,
                  middle: LoadedModel | None = None, guard: Transformer | None = None) -> Decoder:
    """The Decoder for `config`: the plain loop, or speculative decoding with the named drafter. With a
    `middle` model, a cascade: the drafter drafts for `middle`, whose own output drafts for `target`. With a
    `guard` model, positions where the target's margin is below config.guard are re-scored by it."""
    if config.drafter == "none" and middle is None:
        if config.guard is not None:
            raise ValueError("--guard re-scores speculative decoding's verify steps: it needs a drafter")
        return autoregressive
    from quasar.decoding.drafters import DrafterOptions, build_drafter
    from quasar.decoding.speculative import AUTO, Speculative

    options = DrafterOptions(ngram_min=config.ngram_min, ngram_max=config.ngram_max, cache_dir=cache_dir)
    if middle is None:
        from quasar.decoding.confidence_guard import Guard

        checker = None if guard is None else Guard(guard, config.guard)
        return Speculative(build_drafter(config.drafter, target, options), config.k, checker)
    from quasar.decoding.cascade import CascadeDrafter

    inner = build_drafter(config.drafter, middle, options)
    return Speculative(CascadeDrafter(middle.model, inner, config.k), AUTO)


def build_engine(
    model: str | Path = "default",
    verifier: str = "fp32",
    decode: DecodeConfig = DecodeConfig(),
    max_context: int | None = None,
    cache_dir: str | Path | None = None,
) -> Engine:
    """verifier: a name from quasar.verifiers.registry, or a cascade MIDDLE+TOP such as 'w8a8+bf16' (the output is TOP's)."""
    middle_name, top = cascade_levels(verifier)
    guard = None
    if decode.guard is not None:  # first: it refuses the verifiers it cannot guard
        from quasar.decoding.confidence_guard import guard_model

        guard = guard_model(model, verifier, cache_dir)
    target = load_verifier(model, top, cache_dir)
    middle = None if middle_name is None else load_verifier(model, middle_name, cache_dir)
    decoder = build_decoder(target, decode, cache_dir, middle, guard)
    return Engine(target, decoder, max_context=max_context, path=verifier_path(target, middle))


def verifier_path(target: LoadedModel, middle: LoadedModel | None = None) -> str:
    """The kernel paths that compute a verifier's outputs, as reports print them beside their figures: the model's
    backend ('kernels:dpbusd', 'torch', ...), or a cascade's 'MIDDLE > TOP'."""
    return target.model.backend if middle is None else f"{middle.model.backend} > {target.model.backend}"


class LLM:
    """A model loaded once for generation: `generate` (batch of prompts), `stream` (pieces), `chat`."""

    def __init__(
        self,
        model: str | Path = "default",
        verifier: str = "fp32",
        drafter: str = "none",
        k: int | str = "auto",
        ngram_min: int = 1,
        ngram_max: int = 3,
        max_context: int | None = None,
        cache_dir: str | Path | None = None,
        guard: float | None = None,
        max_batch: int = 16,
        max_batch_tokens: int = 64,
    ) -> None:
        decode = DecodeConfig(drafter, k, ngram_min, ngram_max, guard)
        self.engine = build_engine(model, verifier, decode, max_context, cache_dir)
        self.batch = Batch(self.engine, max_batch, max_batch_tokens)

    @property
    def tokenizer(self) -> Any:  # a transformers tokenizer
        return self.engine.tokenizer

    def generate(
        self, prompts: str | Sequence[str], params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Complete each prompt (raw text unless chat=True), batched; outputs in the prompts' order. `params`: one
        SamplingParams for all, or one per prompt."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        return self.run([(self.engine.encode(p, chat), p) for p in prompts], params)

    def run(self, prompts: list[tuple[list[int], Any]], params: SamplingParams | Sequence[SamplingParams] | None
            ) -> list[RequestOutput]:
        """(prompt ids, prompt as given) pairs through one batch."""
        each = [params or SamplingParams()] * len(prompts) if not isinstance(params, Sequence) else list(params)
        if len(each) != len(prompts):
            raise ValueError(f"{len(each)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
        requests = [self.engine.request(ids, p, prompt) for (ids, prompt), p in zip(prompts, each)]
        self.batch.run_all(requests)
        return [r.output for r in requests]

    def stream(self, prompt: str | Messages, params: SamplingParams | None = None, chat: bool = False) -> Iterator[str]:
        """Text pieces as they are generated; stopping the iteration early stops the generation.
        A string prompt is raw text unless chat=True; a list of messages is a conversation (quasar.decoding.prompt.encode)."""
        run = self.engine.run(self.engine.encode(prompt, chat), params or SamplingParams(), prompt)
        try:
            yield from run
        finally:
            run.close()

    def chat(self, messages: Messages | Sequence[Messages], params: SamplingParams | None = None
             ) -> RequestOutput | list[RequestOutput]:
        """Answer one conversation (a list of {'role', 'content'} dicts), or each of several."""
        if messages and isinstance(messages[0], dict):
            conversation = list(messages)
            return self.run([(self.engine.encode(conversation), conversation)], params)[0]
        conversations = [list(c) for c in messages]  # type: ignore[misc]
        return self.run([(self.engine.encode(c), c) for c in conversations], params)
