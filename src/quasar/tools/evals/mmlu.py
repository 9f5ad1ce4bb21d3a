"""MMLU accuracy by one forward pass: after the question and its four choices, the answer is the letter
A/B/C/D whose token the model scores highest at the next position. Nothing is generated.

Consecutive prompts share their start (the chat template, the instruction, the subject: a third of a prompt
on Qwen2.5), so on quasar's kernels the cache keeps the previous prompt and only the tokens after the common
prefix are run: every row is computed from its own input and the keys before it, so the logits are bitwise a
fresh prefill's (tests/test_evals.py). The torch path prefills each prompt whole."""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

import torch

from quasar.decoding.engine import Engine, PromptTooLongError
from quasar.tools.evals import data
from quasar.tools.evals.task import ItemResult, TaskOptions
from quasar.decoding.autoregressive import prefill
from quasar.model.kv_cache import StreamCache


def prompt_text(item: data.MMLUItem) -> str:
    """The zero-shot MMLU format of Hendrycks et al., with an instruction for chat models."""
    choices = "\n".join(f"{letter}. {choice}" for letter, choice in zip(data.LETTERS, item.choices))
    return (
        f"The following is a multiple choice question about {item.topic}. "
        f"Reply with the letter of the correct answer only.\n\n{item.question}\n{choices}"
    )


def letter_token_ids(tokenizer: Any) -> dict[str, tuple[int, ...]]:
    """Each letter's single-token spellings ('A' and ' A'), the ways the next token can state it."""
    ids: dict[str, tuple[int, ...]] = {}
    for letter in data.LETTERS:
        spellings = [tokenizer.encode(s, add_special_tokens=False) for s in (letter, f" {letter}")]
        ids[letter] = tuple(sorted({t[0] for t in spellings if len(t) == 1}))
        if not ids[letter]:
            raise ValueError(f"the tokenizer has no single token for the answer letter {letter!r}")
    return ids


def choose(logits: torch.Tensor, letter_ids: dict[str, tuple[int, ...]]) -> str:
    """logits [V] at the answer position -> the letter whose best spelling scores highest."""
    scores = {letter: float(logits[list(ids)].max()) for letter, ids in letter_ids.items()}
    return max(scores, key=scores.__getitem__)


def encode(engine: Engine, item: data.MMLUItem) -> list[int]:
    """Chat models answer in the assistant turn; plain models after 'Answer:'."""
    if engine.tokenizer.chat_template:
        return engine.encode([{"role": "user", "content": prompt_text(item)}])
    return engine.encode(prompt_text(item) + "\nAnswer:", chat=False)


def answer_logits(engine: Engine, prompt_ids: list[int], stream: StreamCache | None = None) -> torch.Tensor:
    """One forward over the prompt -> logits [V] of the next token; with `stream` (the previous prompt's cache,
    on quasar's kernels) only over what follows the prefix it shares with the previous prompt."""
    if len(prompt_ids) >= engine.max_context:
        raise PromptTooLongError(f"an MMLU prompt has {len(prompt_ids)} tokens; the context window holds {engine.max_context}")
    model = engine.target.model
    if stream is None:
        return prefill(model, engine.fresh_cache(len(prompt_ids) + 1), prompt_ids)
    cache = stream.ready(len(prompt_ids) + 1)
    feed = stream.follow(prompt_ids)
    logits = prefill(model, cache, feed)
    stream.fed(feed)
    return logits


class MMLU:
    name = "mmlu"

    def __init__(self) -> None:
        self.streams: WeakKeyDictionary[Engine, StreamCache] = WeakKeyDictionary()  # the cache of an engine's previous prompt

    def load(self, limit: int | None) -> list[data.MMLUItem]:
        return data.mmlu(limit)

    def stream(self, engine: Engine) -> StreamCache | None:
        if not engine.target.model.plan.batches_rows:  # the torch path's floats depend on how a prompt is split
            return None
        if engine not in self.streams:
            self.streams[engine] = StreamCache(engine.target.model, initial_len=1024)
        return self.streams[engine]

    def score(self, engine: Engine, item: data.MMLUItem, options: TaskOptions) -> ItemResult:
        logits = answer_logits(engine, encode(engine, item), self.stream(engine))
        letter = choose(logits, letter_token_ids(engine.tokenizer))
        return ItemResult(item.id, letter == item.answer, letter)

