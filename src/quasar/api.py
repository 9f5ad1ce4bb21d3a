"""The Python API, shaped like vLLM's offline `LLM`:

    from quasar import LLM, SamplingParams
    llm = LLM("default", drafter="ngram")    # verifier="auto": a quantized GGUF's own blocks, W8A8 for a float model
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_new_tokens=32))
    print(outputs[0].text, outputs[0].stats.mean_accepted_tokens)

`generate` runs its prompts together in continuous batches (quasar.decoding.batch): up to `max_batch` of them share
each forward, and each gets the tokens it would get alone. One LLM is not thread-safe: for concurrent callers,
serve it (`quasar serve`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from quasar.builder import Verifiers, build_engine
from quasar.decoding.batch import Batch
from quasar.decoding.drafters.base import DrafterOptions
from quasar.decoding.outputs import RequestOutput
from quasar.decoding.prompt import Messages
from quasar.decoding.sampling import SamplingParams
from quasar.files import use_cache_dir
from quasar.spec import EngineSpec, parse_k, parse_levels, parse_tree


class LLM:
    """A model loaded once for generation: `generate` (batch of prompts), `stream` (pieces), `chat`."""

    def __init__(
        self,
        model: str | Path = "default",
        verifier: str = "auto",
        drafter: str = "none",
        k: int | str = "auto",
        ngram_min: int = 1,
        ngram_max: int = 3,
        max_context: int | None = None,
        cache_dir: str | Path | None = None,
        guard: float | None = None,
        tree: int | str = 1,
        max_batch: int = 16,
        max_batch_tokens: int = 64,
    ) -> None:
        spec = EngineSpec(parse_levels(verifier), drafter, parse_k(k), guard, parse_tree(tree))
        if cache_dir is not None:  # the process's cache folder from now on
            use_cache_dir(cache_dir)
        options = DrafterOptions(ngram_min, ngram_max)
        self.engine = build_engine(spec, Verifiers(model), options, max_context)
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
