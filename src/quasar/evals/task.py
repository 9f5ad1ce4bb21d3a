"""The Task protocol: a task loads its items and scores one item with an Engine (the table is evals.runner.TASKS)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from quasar.engine import Engine


@dataclass(frozen=True)
class TaskOptions:
    """Knobs shared by the tasks; each task reads the ones it needs."""

    max_new_tokens: int | None = None  # generative tasks; None: the task's own default
    timeout_s: float = 10.0  # HumanEval: seconds one completion's tests may run


@dataclass(frozen=True)
class ItemResult:
    id: str
    correct: bool
    prediction: str  # the answer compared across verifiers: the extracted number, the letter, the code
    output: str = ""  # what else explains the score: the raw completion, the harness's verdict


class Task(Protocol):
    name: str

    def load(self, limit: int | None) -> list[Any]: ...

    def score(self, engine: Engine, item: Any, options: TaskOptions) -> ItemResult: ...
