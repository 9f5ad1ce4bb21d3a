"""Run every method on every prompt in one process: warm-up first, then interleaved prompt by prompt
(method order rotated from prompt to prompt), same prompts, same token budget, same seeds. With `repeat` > 1 every
method answers each prompt that many times, interleaved (the order rotated each time, every round from no kept KV
cache), and keeps the answer of median time: a slow phase of the machine during one answer no longer decides a
category's ratio.

Each finished prompt appends one Spec-Bench answer record per method to answers.jsonl in one write, so
Ctrl-C loses at most the prompt in flight; a prompt is written only when every method has answered it.
answers.jsonl must not exist yet: an earlier run's answers are never truncated.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quasar.tools.bench.base import Method
from quasar.tools.bench.metrics import Record, choice
from quasar.tools.bench.suites import BenchItem
from quasar.decoding.engine import PromptTooLongError
from quasar.decoding.sampling import SamplingParams
from quasar.progress import progress

log = logging.getLogger("quasar")
WARMUP_PROMPT = "Write one sentence about the sea."


@dataclass(frozen=True)
class RunConfig:
    temperatures: tuple[float, ...] = (0.0,)
    max_new_tokens: int = 128
    seed: int = 0
    warmup_tokens: int = 16
    repeat: int = 1  # answers per method and prompt; the one of median wall time is kept


@dataclass
class RunResult:
    records: list[Record] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # question ids whose prompt did not fit the context
    failed: dict[str, str] = field(default_factory=dict)  # method -> "question_id: error" that stopped it
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
        choice["wall_time"].append(out.stats.wall_s)
        choice["decoding_steps"].append(out.stats.verify_steps)
        choice["accept_lengths"].extend(out.stats.accept_lengths)
        choice["token_ids"].append(out.token_ids)
        choice["stats"].append(out.stats.to_dict())
    return {
        "question_id": item.question_id, "category": item.category, "model_id": method.name,
        "temperature": temperature, "answer_id": f"{method.name}/{item.question_id}/T{temperature}",
        "choices": [{"index": 0, **choice}], "tstamp": time.time(),
    }


def warm_up(active: list[Method], tokens: int, result: RunResult) -> None:
    params = SamplingParams(max_new_tokens=tokens)
    for method in list(active):
        try:
            method.generate([{"role": "user", "content": WARMUP_PROMPT}], params)
        except Exception as e:  # noqa: BLE001 - a peer may raise anything; the run must go on
            drop(method, "warm-up", e, active, result)


def drop(method: Method, where: str, error: Exception, active: list[Method], result: RunResult) -> None:
    """A method that raised (a peer's bug, say) is reported and left out of the rest of the run."""
    log.error("%s failed on %s (%s: %s); leaving it out of the rest of the run", method.name, where,
              type(error).__name__, error)
    result.failed[method.name] = f"{where}: {type(error).__name__}: {error}"
    active.remove(method)


def rotated(methods: list[Method], i: int) -> list[Method]:
    shift = i % len(methods)
    return methods[shift:] + methods[:shift]


def schedule(items: list[BenchItem], config: RunConfig) -> Iterator[tuple[float, int, BenchItem]]:
    for temperature in config.temperatures:
        for i, item in enumerate(items):
            yield temperature, i, item


def answer_all(order: list[Method], item: BenchItem, params: SamplingParams, temperature: float,
               active: list[Method], result: RunResult) -> list[Record]:
    """Every method's answer to one question. A method that raises is dropped (see `drop`) instead of ending
    the run; a prompt too long for the context skips the question."""
    batch = []
    for method in order:
        try:
            batch.append(answer(method, item, params, temperature))
        except PromptTooLongError:
            raise
        except Exception as e:  # noqa: BLE001 - a peer may raise anything; the run must go on
            drop(method, item.question_id, e, active, result)
    return batch


def median_answers(rounds: list[list[Record]]) -> list[Record]:
    """Each method's answer of median wall time (the lower middle one of an even count) over the rounds of one
    prompt, with every round's wall time (`wall_times`, seconds) beside it; methods in their order of the first
    round."""
    by_method: dict[str, list[Record]] = {}
    for records in rounds:
        for record in records:
            by_method.setdefault(record["model_id"], []).append(record)
    kept = []
    for records in by_method.values():
        times = [sum(choice(record)["wall_time"]) for record in records]
        middle = sorted(range(len(records)), key=times.__getitem__)[(len(records) - 1) // 2]
        kept.append({**records[middle], "wall_times": times})
    return kept


def answer_rounds(item: BenchItem, params: SamplingParams, temperature: float, i: int, repeat: int,
                  active: list[Method], result: RunResult) -> list[Record]:
    """Every method's answer to question i; with repeat > 1 each method answers it that many times, the order
    rotated each round, every round from no kept cache (`Method.forget`), and keeps its answer of median time."""
    if repeat == 1:
        return answer_all(rotated(active, i), item, params, temperature, active, result)
    rounds = []
    for r in range(repeat):
        if not active:
            break
        for method in active:
            method.forget()
        rounds.append(answer_all(rotated(active, i + r), item, params, temperature, active, result))
    names = {method.name for method in active}  # a method that failed in a later round is out of the run
    return [record for record in median_answers(rounds) if record["model_id"] in names]


def run(methods: list[Method], items: list[BenchItem], config: RunConfig, answers: Path) -> RunResult:
    """Benchmark `methods` on `items`; returns what finished (Ctrl-C stops cleanly after writing it)."""
    result = RunResult()
    if not methods:
        raise ValueError("no method to run")
    answers.parent.mkdir(parents=True, exist_ok=True)
    total = len(items) * len(config.temperatures)
    with open(answers, "x") as out:
        done, active = 0, list(methods)
        try:
            warm_up(active, config.warmup_tokens, result)
            for temperature, i, item in progress(schedule(items, config), "bench: prompts", total=total):
                if not active:
                    log.error("every method failed; stopping")
                    break
                params = SamplingParams(temperature=temperature, max_new_tokens=config.max_new_tokens,
                                        seed=config.seed + i)
                try:
                    batch = answer_rounds(item, params, temperature, i, config.repeat, active, result)
                except PromptTooLongError as e:
                    log.warning("skipping %s: %s", item.question_id, e)
                    result.skipped.append(item.question_id)
                    batch = []
                batch.sort(key=lambda r: [m.name for m in methods].index(r["model_id"]))
                out.write("".join(json.dumps(record) + "\n" for record in batch))  # whole, even on Ctrl-C
                out.flush()
                result.records.extend(batch)
                done += 1
        except KeyboardInterrupt:
            result.interrupted = True
            log.warning("interrupted: keeping the %d prompts that finished", done)
    return result
