"""Run eval tasks on several verifiers of one model and put float, w8a8, w8a16 and pruned side by side.

Every verifier sees the same items (a fixed, evenly spread subset under --limit) and the same prompts; the
deltas are in percentage points against the first verifier listed (the float baseline by convention).

How the answers are computed does not change them: generative tasks decode up to `batch` items at once
(continuous batching) with n-gram drafting by default, and on quasar's kernels every row is computed from its
own input only and greedy speculative decoding emits exactly the verifier's own greedy tokens, so each item
gets the answer it gets alone with plain decoding (tests/test_evals.py checks it). On a 1.5B model that is
several times the items per hour: a step reads the weights once for every item in flight.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from quasar.builder import Verifiers, build_engine, model_source
from quasar.spec import NO_DRAFTER, EngineSpec, VerifierSpec, check_drafter
from quasar.decoding.batch import Batch
from quasar.decoding.engine import Engine, PromptTooLongError
from quasar.decoding.request import Request
from quasar.tools.evals.task import ForwardTask, GenerativeTask, ItemResult, Task, TaskOptions, is_generative
from quasar.progress import progress
from quasar.registry import lookup

# name -> "module:class" of a Task
TASKS: dict[str, str] = {
    "gsm8k": "quasar.tools.evals.gsm8k:GSM8K",
    "humaneval": "quasar.tools.evals.humaneval:HumanEval",
    "mmlu": "quasar.tools.evals.mmlu:MMLU",
}


def get_task(name: str) -> Task:
    return lookup(TASKS, name, "eval task")()


log = logging.getLogger("quasar")
TOO_LONG = "prompt longer than the context window"  # the output of an item that could not be asked
CHECKPOINT_S = 10.0  # a task in progress is reported (saved) at most this often
BATCH = 16  # generative items decoded at once (a 1.5B step with 16 rows costs 2.3-2.7x a 1-row step here)
DRAFTER = "ngram"  # the drafter of the generative tasks' decoding (greedy: the verifier's own tokens)


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion correct / n (95% for z = 1.96), in percent; (0, 100) for n = 0."""
    if n == 0:
        return 0.0, 100.0
    p = correct / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * max(0.0, center - half), 100 * min(1.0, center + half)


def paired_delta_interval(base: list[bool], other: list[bool], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% interval of accuracy(other) - accuracy(base) in points, the two scored on the same items: the
    percentile bootstrap over items, resampling each item's pair together (deterministic: a fixed seed).
    Tighter than two Wilson intervals, because the verifiers agree on most items; zero wide when no item's
    score differs (then the data show no difference, but cannot bound one either)."""
    if len(base) != len(other) or not base:
        raise ValueError("paired scores of the same, non-empty list of items expected")
    n = len(base)
    gained = sum(o and not b for b, o in zip(base, other))  # items only `other` gets right
    lost = sum(b and not o for b, o in zip(base, other))
    # A resample of n items draws each kind of item a binomial number of times: O(rounds), whatever n is.
    g = torch.Generator().manual_seed(seed)
    draws = torch.full((rounds,), float(n), dtype=torch.float64)
    up = torch.binomial(draws, torch.full_like(draws, gained / n), generator=g)
    rest = draws - up
    down = torch.binomial(rest, torch.full_like(draws, lost / (n - gained) if n > gained else 0.0), generator=g)
    means = torch.sort((up - down) / n).values
    low = round(0.025 * (rounds - 1))
    return 100 * float(means[low]), 100 * float(means[rounds - 1 - low])


@dataclass(frozen=True)
class EvalConfig:
    model: str | Path = "default"
    verifiers: tuple[str, ...] = ("fp32",)
    tasks: tuple[str, ...] = ("gsm8k", "humaneval", "mmlu")
    limit: int | None = None  # items per task; None: the whole set
    options: TaskOptions = field(default_factory=TaskOptions)
    max_context: int | None = None

    def __post_init__(self) -> None:
        if not self.verifiers or not self.tasks:
            raise ValueError("give at least one verifier and one task")
        if len(set(self.verifiers)) != len(self.verifiers):
            raise ValueError(f"a verifier is listed twice: {', '.join(self.verifiers)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {self.limit}")


THEN = ", then "  # between the paths of a row whose items were scored on several (a resumed run)


@dataclass
class TaskScore:
    task: str
    verifier: str
    items: list[ItemResult]
    seconds: float
    path: str = ""  # what computed the items (the verifier's backend, 'kernels:amx'); two if a resumed run changed it

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

    def delta_interval(self, baseline: TaskScore) -> tuple[float, float] | None:
        """95% interval of the accuracy difference in points, paired by item (None until both scored the same items)."""
        if self.n != baseline.n or not self.n:
            return None
        return paired_delta_interval([r.correct for r in baseline.items], [r.correct for r in self.items])

    def agreement(self, baseline: TaskScore) -> float:
        """Share of items whose prediction equals the baseline's (the same answer, right or wrong)."""
        pairs = list(zip(self.items, baseline.items))
        return sum(a.prediction == b.prediction for a, b in pairs) / len(pairs) if pairs else 0.0


@dataclass
class EvalReport:
    config: EvalConfig
    scores: dict[tuple[str, str], TaskScore] = field(default_factory=dict)  # (verifier, task) -> score
    run: dict[str, Any] = field(default_factory=dict)  # how it was computed (batch, drafter): not the answers

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
                    "accuracy_pct": 100 * score.accuracy, "ci95_pct": wilson(score.correct, score.n),
                    "delta_pp": self.delta(verifier, task),
                    "delta_ci95_pp": None if base is None else score.delta_interval(base),
                    "agreement_pct": None if base is None else 100 * score.agreement(base),
                    "seconds": score.seconds, "path": score.path,
                })
        return rows

    def to_dict(self, with_items: bool = True) -> dict[str, Any]:
        config = asdict(self.config)
        config["model"] = str(config["model"])
        out: dict[str, Any] = {"config": config, "run": self.run, "baseline": self.baseline, "rows": self.rows()}
        if with_items:
            out["items"] = {
                f"{v}/{t}": [asdict(r) for r in s.items] for (v, t), s in self.scores.items()
            }
        return out


def check_verifiers(names: tuple[str, ...]) -> list[VerifierSpec]:
    """Each name's VerifierSpec, before any work: an unknown or malformed name fails here."""
    return [VerifierSpec.parse(name) for name in names]


def too_long(item: Any) -> ItemResult:
    """The result of an item whose prompt does not fit the context window: wrong."""
    log.warning("%s: %s, scored as wrong", item.id, TOO_LONG)
    return ItemResult(item.id, False, "", TOO_LONG)


def score_item(task: ForwardTask, engine: Engine, item: Any, options: TaskOptions) -> ItemResult:
    """The task's score of one item; a prompt that does not fit the context window counts as wrong."""
    try:
        return task.score(engine, item, options)
    except PromptTooLongError:
        return too_long(item)


def generated(task: GenerativeTask, engine: Engine, items: list[Any], options: TaskOptions,
              batch: int) -> Iterator[ItemResult]:
    """A generative task's results, in item order, decoding up to `batch` items at once; a prompt that does not
    fit the context window counts as wrong. Stopping early cancels the items in flight."""
    running = Batch(engine, max_batch=batch)
    ahead = iter(enumerate(items))
    flying: dict[Request, tuple[int, Any]] = {}
    finished: dict[int, ItemResult] = {}
    following = 0  # the next index to yield

    def launch() -> None:
        while len(flying) < batch:
            i, item = next(ahead, (-1, None))
            if item is None:
                return
            ids, params = task.ask(engine, item, options)
            try:
                request = engine.request(ids, params)
            except PromptTooLongError:
                finished[i] = too_long(item)
                continue
            running.add(request)
            flying[request] = (i, item)

    try:
        launch()
        while True:
            while following in finished:
                yield finished.pop(following)
                following += 1
            if not flying:
                return
            for request in running.step():
                i, item = flying.pop(request)
                if request.error is not None:
                    raise request.error
                finished[i] = task.judge(item, request.output.text, options)
            launch()
    finally:
        for request in flying:
            running.cancel(request)
        running.close()


def score_task(engine: Engine, task_name: str, items: list[Any], verifier: str, options: TaskOptions,
               done: TaskScore | None = None, checkpoint: Callable[[TaskScore], None] | None = None,
               batch: int = 1) -> TaskScore:
    """The task on every item, after those `done` scored before (a resumed run: the first items, in order);
    a generative task decodes up to `batch` items at once. checkpoint(partial score) at most every CHECKPOINT_S
    seconds."""
    task = get_task(task_name)
    path = engine.target.model.plan.paths
    score = done or TaskScore(task_name, verifier, [], 0.0, path)
    todo = items[score.n :]
    if todo and score.path.rpartition(THEN)[2] != path:
        # bf16 sums on AMX tiles are other floats than on the other float paths (the int8 paths all agree)
        if score.path:
            log.warning("%s/%s: its first %d items ran on %s, the rest run on %s here", verifier, task_name, score.n,
                        score.path, path)
        score.path = f"{score.path or 'not recorded'}{THEN}{path}" if score.n else path
    if is_generative(task):
        results = generated(task, engine, todo, options, batch)  # type: ignore[arg-type]
    else:
        results = (score_item(task, engine, item, options) for item in todo)  # type: ignore[arg-type]
    start, last = time.perf_counter(), time.perf_counter()
    seconds = score.seconds
    with closing(results):
        for result in progress(results, f"{task_name} [{verifier}]", total=len(items), initial=score.n):
            score.items.append(result)
            score.seconds = seconds + time.perf_counter() - start
            if checkpoint is not None and time.perf_counter() - last >= CHECKPOINT_S:
                checkpoint(score)
                last = time.perf_counter()
    return score


def resume_scores(saved: dict[str, Any], config: EvalConfig, items: dict[str, list[Any]]) -> dict[tuple[str, str], TaskScore]:
    """The scores of a report saved by an earlier run of the same config (EvalReport.to_dict), to go on from.
    The config may add verifiers and tasks to the saved ones (a scheme added to a finished table scores only
    the new rows); every other setting must be the same. Raises ValueError when the settings differ, a saved
    verifier or task is left out (its items would be lost), or the saved items are not the set's first ones."""
    mine = json.loads(json.dumps(EvalReport(config).to_dict(with_items=False)["config"]))  # as a saved file has it
    theirs = json.loads(json.dumps(saved.get("config") or {}))
    added = {key for key in ("verifiers", "tasks") if set(theirs.get(key) or ()) <= set(mine.get(key) or ())}
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k) and k not in added)
    if differ:
        raise ValueError(f"the saved report was made with other settings ({', '.join(differ)}); run with those "
                         "settings (verifiers and tasks may be added, not left out), or start over with --overwrite")
    rows = {(r["verifier"], r["task"]): r for r in saved.get("rows", [])}
    scores = {}
    for key, results in saved.get("items", {}).items():
        verifier, _, task = key.partition("/")
        done = [ItemResult(**r) for r in results]
        if [r.id for r in done] != [item.id for item in items[task][: len(done)]]:
            raise ValueError(f"the saved {key} items are not this set's first {len(done)}; start over with --overwrite")
        row = rows.get((verifier, task), {})
        scores[(verifier, task)] = TaskScore(task, verifier, done, row.get("seconds", 0.0), row.get("path", ""))
    return scores


def evaluate(config: EvalConfig, on_score: Callable[[EvalReport], None] | None = None,
             resume: dict[str, Any] | None = None, on_progress: Callable[[EvalReport], None] | None = None,
             batch: int = BATCH, drafter: str = DRAFTER) -> EvalReport:
    """Every task on every verifier; verifiers are loaded one at a time and freed before the next.
    on_score(report) runs after each (verifier, task), e.g. to save what is finished; on_progress(report) every
    CHECKPOINT_S seconds within a task (the task's row then counts the items scored so far). resume: a report
    saved by an earlier run of this config (EvalReport.to_dict): its items are kept, the rest are scored, and a
    verifier whose tasks are all done is not loaded. batch, drafter: how generative tasks decode (items at once,
    'none' or a drafter's name); neither changes an answer on quasar's kernels."""
    if batch < 1:
        raise ValueError(f"the batch must be >= 1 items, got {batch}")
    check_verifiers(config.verifiers)
    check_drafter(drafter)
    for name in config.tasks:  # unknown names before the model path
        lookup(TASKS, name, "eval task")
    source = model_source(config.model)
    items = {name: get_task(name).load(config.limit) for name in config.tasks}
    report = EvalReport(config, run={"batch": batch, "drafter": drafter})
    done = resume_scores(resume, config, items) if resume else {}
    report.scores.update(done)  # every saved item is in each save from the start, whatever order runs next
    for verifier in config.verifiers:
        todo = [n for n in config.tasks if (verifier, n) not in done or done[(verifier, n)].n < len(items[n])]
        engine = None
        if todo:
            log.info("loading verifier %s of %s", verifier, config.model)
            generates = any(is_generative(get_task(n)) for n in todo)  # else no drafter is loaded
            spec = EngineSpec((VerifierSpec.parse(verifier),), drafter if generates else NO_DRAFTER)
            engine = build_engine(spec, Verifiers(source), max_context=config.max_context)
        for name in config.tasks:
            def checkpoint(partial: TaskScore, key: tuple[str, str] = (verifier, name)) -> None:
                report.scores[key] = partial
                if on_progress is not None:
                    on_progress(report)

            previous = done.get((verifier, name))
            if name in todo:
                score = score_task(engine, name, items[name], verifier, config.options, previous, checkpoint, batch)
            else:
                score = previous
            report.scores[(verifier, name)] = score
            log.info("%s on %s: %d/%d correct", verifier, name, score.correct, score.n)
            if on_score is not None:
                on_score(report)
        del engine
        gc.collect()
    return report


def delta_text(row: dict[str, Any]) -> tuple[str, str]:
    """A row's delta against the baseline and its paired 95% interval, as text ('' where there is none)."""
    if row["delta_pp"] is None:
        return "", ""
    interval = row["delta_ci95_pp"]
    return f"{row['delta_pp']:+.1f}", "" if interval is None else f"{interval[0]:+.1f} to {interval[1]:+.1f}"


def markdown_table(report: EvalReport) -> str:
    """The accuracy table as Markdown: task, verifier, n, accuracy, delta vs baseline (paired interval), agreement."""
    base = report.baseline
    lines = [
        f"| task | verifier | n | accuracy % | 95% CI (Wilson) | Δ vs {base} (pp) | Δ 95% CI (paired) "
        f"| agrees with {base} % | path |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in report.rows():
        is_base = row["verifier"] == base
        delta, interval = ("", "") if is_base else delta_text(row)
        agree = "" if is_base or row["agreement_pct"] is None else f"{row['agreement_pct']:.1f}"
        low, high = row["ci95_pct"]
        lines.append(f"| {row['task']} | {row['verifier']} | {row['n']} | {row['accuracy_pct']:.1f} | {low:.1f}-{high:.1f} "
                     f"| {delta} | {interval} | {agree} | {row['path']} |")
    return "\n".join(lines)
