"""PNG plots of a bench run (matplotlib, no display needed). Each function takes plain data and a path."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from quasar.tools.bench.metrics import ALL, Record, choice


def save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def speedup_by_category(rows: list[dict[str, Any]], baseline: str, path: Path) -> Path:
    """Grouped bars: speedup vs `baseline` per category, one bar per method (lowest temperature)."""
    temperature = min(r["temperature"] for r in rows)
    rows = [r for r in rows if r["temperature"] == temperature and r["method"] != baseline]
    categories = list(dict.fromkeys(r["category"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    value = {(r["method"], r["category"]): r.get(f"speedup_vs_{baseline}") or 0.0 for r in rows}
    fig, ax = plt.subplots(figsize=(max(6, len(categories) * 0.9), 4))
    width = 0.8 / max(1, len(methods))
    for j, method in enumerate(methods):
        xs = [i + j * width for i in range(len(categories))]
        ax.bar(xs, [value.get((method, c), 0.0) for c in categories], width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(categories))], categories, rotation=30, ha="right")
    ax.set_ylabel(f"speedup vs {baseline}")
    ax.set_title(f"Speedup per category (T={temperature:g})")
    ax.legend(fontsize=8)
    return save(fig, path)


def accept_length_distribution(records: list[Record], path: Path) -> Path:
    """Share of verify steps that emitted n tokens, per method (methods that report steps)."""
    counts: dict[str, Counter] = {}
    for r in records:
        counts.setdefault(r["model_id"], Counter()).update(choice(r).get("accept_lengths") or ())
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, counter in counts.items():
        total = sum(counter.values())
        if total:
            lengths = sorted(counter)
            ax.plot(lengths, [counter[n] / total for n in lengths], marker="o", label=method)
    ax.set_xlabel("tokens emitted per verify step")
    ax.set_ylabel("share of steps")
    ax.set_title("Accepted-length distribution")
    ax.legend(fontsize=8)
    return save(fig, path)


def speedup_vs_temperature(rows: list[dict[str, Any]], baseline: str, path: Path) -> Path:
    """Overall speedup vs `baseline` at each temperature, one line per method."""
    fig, ax = plt.subplots(figsize=(6, 4))
    overall = [r for r in rows if r["category"] == ALL and r["method"] != baseline]
    for method in dict.fromkeys(r["method"] for r in overall):
        points = sorted((r["temperature"], r.get(f"speedup_vs_{baseline}")) for r in overall if r["method"] == method)
        points = [(t, s) for t, s in points if s is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("temperature")
    ax.set_ylabel(f"speedup vs {baseline}")
    ax.set_title("Speedup vs temperature")
    ax.legend(fontsize=8)
    return save(fig, path)


def verify_forward(curves: dict[str, dict[str, Any]], bandwidth: float, path: Path) -> Path:
    """Verify-forward time vs scored tokens per verifier, with each verifier's memory wall
    bytes_per_forward / bandwidth as a dashed line of the same colour."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for verifier, curve in curves.items():
        seconds = {int(n): s for n, s in curve["seconds"].items()}  # JSON turns the keys into strings
        sizes = sorted(seconds)
        line = ax.plot(sizes, [seconds[n] * 1e3 for n in sizes], marker="o", label=verifier)
        wall = curve["bytes"] / bandwidth * 1e3
        ax.axhline(wall, linestyle="--", color=line[0].get_color(),
                   label=f"{verifier}: {curve['bytes'] / 1e6:.0f} MB / {bandwidth / 1e9:.1f} GB/s")
    ax.set_xlabel("scored tokens per verify forward (k+1)")
    ax.set_ylabel("ms per forward")
    ax.set_ylim(bottom=0)
    ax.set_title("Verify forward vs the memory wall")
    ax.legend(fontsize=8)
    return save(fig, path)
