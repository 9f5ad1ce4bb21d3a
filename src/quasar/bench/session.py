"""One `quasar bench` session: build the methods, run them, measure the memory wall, write the outputs.

Outputs in the out directory: answers.jsonl (Spec-Bench answer records), summary.json, summary.md and
the PNG plots; the summary table is also printed.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from quasar import native
from quasar.bench import bandwidth, plots
from quasar.bench.base import MethodOptions, Pool
from quasar.bench.methods import build_methods
from quasar.bench.metrics import BASELINES, Record, divergences, summarize
from quasar.bench.report import write_summary
from quasar.bench.runner import RunConfig, RunResult, run
from quasar.bench.suites import load_suite

log = logging.getLogger("quasar")


@dataclass(frozen=True)
class BenchOptions:
    suite: str = "quick"
    methods: tuple[str, ...] = ("ar:bf16", "ngram+bf16", "ar:w8a8", "ngram+w8a8")
    out: str = "bench-out"
    per_category: int | None = None  # None: the suite's size
    categories: tuple[str, ...] | None = None
    run: RunConfig = field(default_factory=RunConfig)
    model: MethodOptions = field(default_factory=MethodOptions)
    memory_wall: bool = True  # the bandwidth probe and verify-forward curves
    plots: bool = True


def memory_wall(pool: Pool) -> dict[str, Any]:
    """Read bandwidth and, per loaded verifier, verify-forward time vs scored tokens."""
    measured = {"bandwidth_bytes_per_s": bandwidth.read_bandwidth(), "curves": {}}
    for name, loaded in pool.verifiers.items():
        measured["curves"][name] = {
            "bytes": bandwidth.bytes_per_forward(loaded.model),
            "seconds": bandwidth.verify_forward_times(loaded.model),
        }
    return measured


def draw(out: Path, rows: list[dict[str, Any]], records: list[Record], wall: dict[str, Any] | None) -> list[str]:
    baseline = next((b for b in BASELINES if any(r["method"] == b for r in rows)), None)
    made = [plots.accept_length_distribution(records, out / "accept_lengths.png")]
    if baseline:
        made.append(plots.speedup_by_category(rows, baseline, out / "speedup_by_category.png"))
        made.append(plots.speedup_vs_temperature(rows, baseline, out / "speedup_vs_temperature.png"))
    else:
        log.warning("no baseline method (%s) in the run: no speedup plots", " or ".join(BASELINES))
    if wall and wall["curves"]:
        made.append(plots.verify_forward(wall["curves"], wall["bandwidth_bytes_per_s"], out / "verify_forward.png"))
    return [p.name for p in made]


def machine() -> dict[str, Any]:
    kernel = native.kernel()
    return {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "int8_path": kernel.int8_paths()[0] if kernel else "torch"}


def bench(options: BenchOptions) -> tuple[RunResult, dict[str, Any]]:
    """Run the benchmark and write every output; returns what ran (interrupted=True after Ctrl-C) and
    the summary."""
    items = load_suite(options.suite, options.per_category, options.categories)
    pool = Pool(options.model)
    methods = build_methods(list(options.methods), pool)
    out = Path(options.out)
    log.info("%d prompts x %d methods x %d temperatures", len(items), len(methods), len(options.run.temperatures))
    result = run(methods, items, options.run, out / "answers.jsonl")
    wall = None
    if options.memory_wall and not result.interrupted:
        try:
            wall = memory_wall(pool)
        except KeyboardInterrupt:
            result.interrupted = True
    rows, divergent = summarize(result.records), divergences(result.records)
    summary = {
        "config": {"suite": options.suite, "prompts": len(items), "methods": [m.name for m in methods],
                   "temperatures": list(options.run.temperatures), "max_new_tokens": options.run.max_new_tokens,
                   "model": options.model.model, "interrupted": result.interrupted},
        "options": asdict(options), "machine": machine(), "rows": rows, "divergences": divergent,
        "skipped": result.skipped, "failed": result.failed, "memory_wall": wall,
    }
    if rows and options.plots:
        summary["plots"] = draw(out, rows, result.records, wall)
    write_summary(out, summary)
    return result, summary
