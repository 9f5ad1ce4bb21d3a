"""Run every method on every prompt in one process: warm-up first, then interleaved prompt by prompt
(method order rotated from prompt to prompt), same prompts, same token budget, same seeds.

Each finished prompt appends one Spec-Bench answer record per method to answers.jsonl at once, so
Ctrl-C loses at most the prompt in flight; a prompt is written only when every method has answered it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from quasar.bench.methods import Method
from quasar.bench.metrics import Record
from quasar.bench.suites import BenchItem
from quasar.engine import PromptTooLongError
from quasar.sampling import SamplingParams

log = logging.getLogger("quasar")
WARMUP_PROMPT = "Write one sentence about the sea."


@dataclass(frozen=True)
class RunConfig:
    temperatures: tuple[float, ...] = (0.0,)
    max_new_tokens: int = 128
    seed: int = 0
    warmup_tokens: int = 16


@dataclass
class RunResult:
    records: list[Record] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # question ids whose prompt did not fit the context
    interrupted: bool = False


def answer(method: Method, item: BenchItem, params: SamplingParams, temperature: float) -> Record:
    """All turns of one question, each turn conditioned on this method's own earlier answers."""
    messages: list[dict[str, str]] = []
    keys = ("turns", "new_tokens", "wall_time", "decoding_steps", "accept_lengths", "token_ids", "stats")
    choice: dict[str, list[Any]] = {key: [] for key in keys}
    for turn in item.turns:
        messages.append({"role": "user", "content": turn})
        out = method.generate(messages, params)
        messages.append({"role": "assistant", "content": out.text})
        choice["turns"].append(out.text)
        choice["new_tokens"].append(len(out.token_ids))
        choice["wall_time"].append(out.wall_time)
        choice["decoding_steps"].append(out.stats.verify_steps)
        choice["accept_lengths"].extend(out.stats.accept_lengths)
        choice["token_ids"].append(out.token_ids)
        choice["stats"].append(out.stats.to_dict())
    return {
        "question_id": item.question_id, "category": item.category, "model_id": method.name,
        "temperature": temperature, "answer_id": f"{method.name}/{item.question_id}/T{temperature}",
        "choices": [{"index": 0, **choice}], "tstamp": time.time(),
    }


def warm_up(methods: list[Method], tokens: int) -> None:
    params = SamplingParams(max_new_tokens=tokens)
    for method in methods:
        method.generate([{"role": "user", "content": WARMUP_PROMPT}], params)


def rotated(methods: list[Method], i: int) -> list[Method]:
    shift = i % len(methods)
    return methods[shift:] + methods[:shift]


def schedule(items: list[BenchItem], config: RunConfig) -> Iterator[tuple[float, int, BenchItem]]:
    for temperature in config.temperatures:
        for i, item in enumerate(items):
            yield temperature, i, item


def run(methods: list[Method], items: list[BenchItem], config: RunConfig, answers: Path) -> RunResult:
    """Benchmark `methods` on `items`; returns what finished (Ctrl-C stops cleanly after writing it)."""
    result = RunResult()
    if not methods:
        raise ValueError("no method to run")
    answers.parent.mkdir(parents=True, exist_ok=True)
    total = len(items) * len(config.temperatures)
    with open(answers, "w") as out, tqdm(total=total, unit="prompt", desc="bench", disable=None, dynamic_ncols=True) as bar:
        done = 0
        try:
            warm_up(methods, config.warmup_tokens)
            start = time.perf_counter()
            for temperature, i, item in schedule(items, config):
                params = SamplingParams(temperature=temperature, max_new_tokens=config.max_new_tokens,
                                        seed=config.seed + i)
                try:
                    batch = [answer(m, item, params, temperature) for m in rotated(methods, i)]
                except PromptTooLongError as e:
                    log.warning("skipping %s: %s", item.question_id, e)
                    result.skipped.append(item.question_id)
                    batch = []
                batch.sort(key=lambda r: [m.name for m in methods].index(r["model_id"]))
                out.writelines(json.dumps(record) + "\n" for record in batch)
                out.flush()
                result.records.extend(batch)
                done += 1
                bar.update()
                log.info("prompt %d/%d done (%s), about %.0f s left", done, total, item.question_id,
                         (time.perf_counter() - start) / done * (total - done))
        except KeyboardInterrupt:
            result.interrupted = True
            log.warning("interrupted: keeping the %d prompts that finished", done)
    return result
