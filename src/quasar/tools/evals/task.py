"""The Task protocols: a task loads its items and scores each with an Engine (the table is evals.runner.TASKS).

Two kinds: a task answered by one forward (MMLU) scores an item itself (`score`); a generative task (GSM8K,
HumanEval) only says what to ask (`ask`: prompt ids and sampling) and how to judge the completion (`judge`),
so the runner can decode many items at once, sharing each forward (quasar.decoding.batch), with the same answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from quasar.decoding.engine import Engine
from quasar.decoding.sampling import SamplingParams


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


class ForwardTask(Task, Protocol):
    def score(self, engine: Engine, item: Any, options: TaskOptions) -> ItemResult: ...


class GenerativeTask(Task, Protocol):
    def ask(self, engine: Engine, item: Any, options: TaskOptions) -> tuple[list[int], SamplingParams]: ...

    def judge(self, item: Any, completion: str, options: TaskOptions) -> ItemResult: ...


def is_generative(task: Task) -> bool:
    return hasattr(task, "judge")
