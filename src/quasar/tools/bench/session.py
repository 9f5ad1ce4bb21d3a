"""One `quasar bench` session: build the methods, run them, measure the memory wall, write the outputs.

Outputs in the out directory: answers.jsonl (Spec-Bench answer records), summary.json, summary.md and
the PNG plots; the summary table is also printed. The run writes them into a temporary sibling of out that
replaces out when the run ends (or stops on Ctrl-C), so out always holds one whole run: a run that is killed
leaves the previous one in place, and its partial answers in the sibling (`.OUT.tmp.*`).
"""

from __future__ import annotations

import logging
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from quasar.kernels import native
from quasar.model.source import ModelSource
from quasar.tools.bench import bandwidth, plots
from quasar.tools.bench.base import Method, MethodOptions, Pool
from quasar.tools.bench.methods import build_methods
from quasar.tools.bench.metrics import BASELINES, PLAIN_SPEEDUP, Record, divergences, summarize
from quasar.tools.bench.report import write_summary
from quasar.tools.bench.runner import RunConfig, RunResult, run
from quasar.tools.bench.suites import BenchItem, load_suite
from quasar.files import atomic_directory

log = logging.getLogger("quasar")
PLOTS = ("accept_lengths.png", "speedup_by_category.png", "speedup_vs_temperature.png", "verify_forward.png")
OUTPUTS = ("answers.jsonl", "summary.json", "summary.md", *PLOTS)  # what a run writes, and all --overwrite replaces


@dataclass(frozen=True)
class BenchOptions:
    suite: str = "quick"
    methods: tuple[str, ...] | None = None  # None: default_methods(the model)
    out: str = "bench-out"
    per_category: int | None = None  # None: the suite's size
    categories: tuple[str, ...] | None = None
    run: RunConfig = field(default_factory=RunConfig)
    model: MethodOptions = field(default_factory=MethodOptions)
    memory_wall: bool = True  # the bandwidth probe and verify-forward curves
    plots: bool = True
    overwrite: bool = False  # replace an earlier run in `out`


def default_methods(source: ModelSource) -> tuple[str, ...]:
    """What `quasar bench` compares when --methods is not given: on a quantized GGUF, plain and n-gram decoding on
    the file's own blocks (nothing needs a float copy or a calibration); on a float model, plain and n-gram decoding
    with the bf16 and the W8A8 verifier."""
    if source.quantized_file:
        return ("ar:gguf", "ngram+gguf")
    return ("ar:bf16", "ngram+bf16", "ar:w8a8", "ngram+w8a8")


def memory_wall(pool: Pool) -> dict[str, Any]:
    """Read bandwidth and, per loaded verifier, verify-forward time vs scored tokens."""
    measured = {"bandwidth_bytes_per_s": bandwidth.read_bandwidth(), "curves": {}}
    for spec, loaded in pool.verifiers.loaded.items():
        measured["curves"][str(spec)] = {
            "bytes": bandwidth.bytes_per_forward(loaded.model),
            "seconds": bandwidth.verify_forward_times(loaded.model),
        }
    return measured


def draw(out: Path, rows: list[dict[str, Any]], records: list[Record], wall: dict[str, Any] | None) -> list[str]:
    baseline = next((b for b in BASELINES if any(r["method"] == b for r in rows)), None)
    if baseline is None and any(r[PLAIN_SPEEDUP] is not None for r in rows):
        baseline = PLAIN_SPEEDUP.removeprefix("speedup_vs_")  # each speculative method against its own ar:V
    accept, by_category, by_temperature, verify = (out / name for name in PLOTS)
    made = [plots.accept_length_distribution(records, accept)]
    if baseline:
        made.append(plots.speedup_by_category(rows, baseline, by_category))
        made.append(plots.speedup_vs_temperature(rows, baseline, by_temperature))
    else:
        log.warning("no baseline method (%s, or a method's plain decoding) in the run: no speedup plots",
                    " or ".join(BASELINES))
    if wall and wall["curves"]:
        made.append(plots.verify_forward(wall["curves"], wall["bandwidth_bytes_per_s"], verify))
    return [p.name for p in made]


def machine() -> dict[str, Any]:
    """Where the run ran: the CPU, threads, and the kernel paths of quasar's linears (None where no method loaded
    the kernels: a run of peers only does not build them for this)."""
    kernel = native.loaded()
    paths = {"int8_path": kernel.int8_path(), "prefetch": kernel.prefetch(), "bf16_path": kernel.float_path_for(True),
             "float_path": kernel.float_path_for(False)} if kernel else {}
    return {"platform": platform.platform(), "cpu": native.cpu_name(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), **paths}


def machine_line(machine: dict[str, Any]) -> str:
    where = f"{machine['cpu']}, {machine['threads']} threads; quasar kernels: "
    if "int8_path" not in machine:
        return where + "not loaded"
    return where + (f"int8 {machine['int8_path']} (prefetch {machine['prefetch']}), bf16 x bf16 {machine['bf16_path']}, "
                    f"other float {machine['float_path']}")


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse, before any work, to replace an earlier run without `overwrite`, or anything but a bench output."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    if not overwrite:
        raise ValueError(f"{out} holds an earlier run; pass --overwrite to replace it, or choose another --out")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in OUTPUTS)
    if foreign:
        raise ValueError(f"{out} holds files that quasar bench did not write ({', '.join(foreign[:3])}), and "
                         "--overwrite replaces the whole directory; choose another --out")


def bench(options: BenchOptions) -> tuple[RunResult, dict[str, Any]]:
    """Run the benchmark and write every output; returns what ran (interrupted=True after Ctrl-C) and
    the summary."""
    out = Path(options.out)
    check_out(out, options.overwrite)
    items = load_suite(options.suite, options.per_category, options.categories)
    pool = Pool(options.model)
    methods = build_methods(list(options.methods or default_methods(pool.source)), pool)
    log.info("%d prompts x %d methods x %d temperatures", len(items), len(methods), len(options.run.temperatures))
    result, summary = RunResult(), {}

    def write(tmp: Path) -> None:
        nonlocal result, summary
        log.info("writing the run into %s; it replaces %s when the run ends", tmp, out)
        result, summary = measure(options, items, pool, methods, tmp)

    atomic_directory(out, write)
    return result, summary


def measure(options: BenchOptions, items: list[BenchItem], pool: Pool, methods: list[Method],
            out: Path) -> tuple[RunResult, dict[str, Any]]:
    """Run the methods and the memory-wall probe; write answers, summary and plots into out."""
    result = run(methods, items, options.run, out / "answers.jsonl")
    wall = None
    if options.memory_wall and not result.interrupted:
        try:
            wall = memory_wall(pool)
        except KeyboardInterrupt:
            result.interrupted = True
    rows, divergent = summarize(result.records), divergences(result.records)
    paths, where = {m.name: m.path for m in methods}, machine()
    for row in rows:
        row["path"] = paths[row["method"]]
    summary = {
        "config": {"suite": options.suite, "prompts": len(items), "methods": [m.name for m in methods],
                   "temperatures": list(options.run.temperatures), "max_new_tokens": options.run.max_new_tokens,
                   "model": options.model.model, "machine": machine_line(where), "interrupted": result.interrupted},
        "options": asdict(options), "machine": where, "rows": rows, "divergences": divergent,
        "skipped": result.skipped, "failed": result.failed, "memory_wall": wall,
    }
    if rows and options.plots:
        summary["plots"] = draw(out, rows, result.records, wall)
    write_summary(out, summary)
    return result, summary
