"""Run eval tasks on several verifiers of one model and put float, w8a8, w8a16 and pruned side by side.

Every verifier sees the same items (a fixed, evenly spread subset under --limit) and the same prompts; the
deltas are in percentage points against the first verifier listed (the float baseline by convention).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quasar import verifiers
from quasar.engine import Engine, PromptTooLongError
from quasar.evals.task import ItemResult, Task, TaskOptions
from quasar.registry import lookup

# name -> "module:class" of a Task
TASKS: dict[str, str] = {
    "gsm8k": "quasar.evals.gsm8k:GSM8K",
    "humaneval": "quasar.evals.humaneval:HumanEval",
    "mmlu": "quasar.evals.mmlu:MMLU",
}


def get_task(name: str) -> Task:
    return lookup(TASKS, name, "eval task")()
from quasar.progress import progress

log = logging.getLogger("quasar")
TOO_LONG = "prompt longer than the context window"  # the output of an item that could not be asked


@dataclass(frozen=True)
class EvalConfig:
    model: str | Path = "default"
    verifiers: tuple[str, ...] = ("fp32",)
    tasks: tuple[str, ...] = ("gsm8k", "humaneval", "mmlu")
    limit: int | None = None  # items per task; None: the whole set
    options: TaskOptions = field(default_factory=TaskOptions)
    cache_dir: str | Path | None = None
    max_context: int | None = None

    def __post_init__(self) -> None:
        if not self.verifiers or not self.tasks:
            raise ValueError("give at least one verifier and one task")
        if len(set(self.verifiers)) != len(self.verifiers):
            raise ValueError(f"a verifier is listed twice: {', '.join(self.verifiers)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")


@dataclass
class TaskScore:
    task: str
    verifier: str
    items: list[ItemResult]
    seconds: float

    @property
    def n(self) -> int:
        return len(self.items)

    @property
    def correct(self) -> int:
        return sum(r.correct for r in self.items)

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0

    @property
    def too_long(self) -> int:
        return sum(r.output == TOO_LONG for r in self.items)

    def agreement(self, baseline: TaskScore) -> float:
        """Share of items whose prediction equals the baseline's (the same answer, right or wrong)."""
        pairs = list(zip(self.items, baseline.items))
        return sum(a.prediction == b.prediction for a, b in pairs) / len(pairs) if pairs else 0.0


@dataclass
class EvalReport:
    config: EvalConfig
    scores: dict[tuple[str, str], TaskScore] = field(default_factory=dict)  # (verifier, task) -> score

    @property
    def baseline(self) -> str:
        return self.config.verifiers[0]

    def delta(self, verifier: str, task: str) -> float | None:
        """Accuracy minus the baseline verifier's, in percentage points."""
        base, score = self.scores.get((self.baseline, task)), self.scores.get((verifier, task))
        if base is None or score is None:
            return None
        return 100 * (score.accuracy - base.accuracy)

    def rows(self) -> list[dict[str, Any]]:
        """One row per (task, verifier): accuracy %, delta vs the baseline, agreement with it."""
        rows = []
        for task in self.config.tasks:
            base = self.scores.get((self.baseline, task))
            for verifier in self.config.verifiers:
                score = self.scores.get((verifier, task))
                if score is None:
                    continue
                rows.append({
                    "task": task, "verifier": verifier, "n": score.n, "correct": score.correct, "too_long": score.too_long,
                    "accuracy_pct": 100 * score.accuracy, "delta_pp": self.delta(verifier, task),
                    "agreement_pct": None if base is None else 100 * score.agreement(base),
                    "seconds": score.seconds,
                })
        return rows

    def to_dict(self, with_items: bool = True) -> dict[str, Any]:
        config = asdict(self.config)
        config["model"] = str(config["model"])
        out: dict[str, Any] = {"config": config, "baseline": self.baseline, "rows": self.rows()}
        if with_items:
            out["items"] = {
                f"{v}/{t}": [asdict(r) for r in s.items] for (v, t), s in self.scores.items()
            }
        return out


def check_verifiers(names: tuple[str, ...]) -> None:
    """Fail before any work when a verifier name is unknown (the loaders come from other modules)."""
    known = verifiers.available()
    unknown = [n for n in names if n.partition(":")[0] not in known]
    if unknown:
        raise ValueError(f"unknown verifier(s) {', '.join(unknown)}; available: {', '.join(known)}")


def score_item(task: Task, engine: Engine, item: Any, options: TaskOptions) -> ItemResult:
    """The task's score of one item; a prompt that does not fit the context window counts as wrong."""
    try:
        return task.score(engine, item, options)
    except PromptTooLongError:
        log.warning("%s: %s, scored as wrong", item.id, TOO_LONG)
        return ItemResult(item.id, False, "", TOO_LONG)


def score_task(engine: Engine, task_name: str, items: list[Any], verifier: str, options: TaskOptions) -> TaskScore:
    task = get_task(task_name)
    start = time.perf_counter()
    results = [score_item(task, engine, item, options) for item in progress(items, f"{task_name} [{verifier}]")]
    return TaskScore(task_name, verifier, results, time.perf_counter() - start)


def evaluate(config: EvalConfig, on_score: Callable[[EvalReport], None] | None = None) -> EvalReport:
    """Every task on every verifier; verifiers are loaded one at a time and freed before the next.
    on_score(report) runs after each (verifier, task), e.g. to save what is finished."""
    check_verifiers(config.verifiers)
    items = {name: get_task(name).load(config.limit) for name in config.tasks}
    report = EvalReport(config)
    for verifier in config.verifiers:
        log.info("loading verifier %s of %s", verifier, config.model)
        engine = Engine(verifiers.load_verifier(config.model, verifier, config.cache_dir), max_context=config.max_context)
        for name in config.tasks:
            score = score_task(engine, name, items[name], verifier, config.options)
            report.scores[(verifier, name)] = score
            log.info("%s on %s: %d/%d correct", verifier, name, score.correct, score.n)
            if on_score is not None:
                on_score(report)
        del engine
        gc.collect()
    return report


def markdown_table(report: EvalReport) -> str:
    """The accuracy table as Markdown: task, verifier, n, accuracy, delta vs baseline, agreement."""
    lines = [
        f"| task | verifier | n | accuracy % | Δ vs {report.baseline} (pp) | agrees with {report.baseline} % |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in report.rows():
        delta = "" if row["verifier"] == report.baseline or row["delta_pp"] is None else f"{row['delta_pp']:+.1f}"
        agree = "" if row["verifier"] == report.baseline or row["agreement_pct"] is None else f"{row['agreement_pct']:.1f}"
        lines.append(
            f"| {row['task']} | {row['verifier']} | {row['n']} | {row['accuracy_pct']:.1f} | {delta} | {agree} |"
        )
    return "\n".join(lines)
