"""The summary three ways: a rich table on the terminal, summary.md and summary.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from quasar.tools.bench.metrics import BASELINES, PLAIN_SPEEDUP
from quasar.files import atomic_write_text

COLUMNS = (  # (row key, header, format)
    ("category", "category", "{}"),
    ("method", "method", "{}"),
    ("path", "path", "{}"),  # what ran the method: quasar's kernel paths, or the peer's build
    ("prompts", "prompts", "{}"),
    ("new_tokens", "tokens", "{}"),
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("mean_accepted_tokens", "MAT", "{:.2f}"),
    ("acceptance_rate", "accept", "{:.1%}"),
    ("prompt_share", "prompt", "{:.0%}"),  # of the wall time, spent on the prompts
    *((f"speedup_vs_{b}", f"x {b}", "{:.2f}x") for b in BASELINES),
    (PLAIN_SPEEDUP, "x plain", "{:.2f}x"),  # DRAFTER+V against ar:V, the same verifier decoding plainly
)


def shown(rows: list[dict[str, Any]]) -> tuple[tuple[str, str, str], ...]:
    """COLUMNS less the speedup columns that no row has a value for (a baseline method that did not run)."""
    return tuple(c for c in COLUMNS if not c[0].startswith("speedup_vs") or any(r.get(c[0]) is not None for r in rows))


def cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def temperatures(rows: list[dict[str, Any]]) -> list[float]:
    return sorted({r["temperature"] for r in rows})


def rich_tables(rows: list[dict[str, Any]]) -> list[Table]:
    tables = []
    for temperature in temperatures(rows):
        table = Table(title=f"quasar bench, temperature {temperature:g}")
        columns = shown(rows)
        for _, header, _ in columns:
            table.add_column(header, justify="left" if header in ("category", "method", "path") else "right")
        previous = None
        for row in (r for r in rows if r["temperature"] == temperature):
            if previous is not None and row["category"] != previous:
                table.add_section()
            previous = row["category"]
            table.add_row(*(cell(row[key], fmt) for key, _, fmt in columns))
        tables.append(table)
    return tables


def print_summary(rows: list[dict[str, Any]], divergent: list[dict[str, Any]], machine: str = "",
                  console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 160)  # a file or pipe: do not squeeze the columns
    if machine:
        console.print(f"machine: {machine}", highlight=False)
    for table in rich_tables(rows):
        console.print(table)
    for d in divergent:
        console.print(f"[red]divergence[/red]: {d['method']} differs from {d['reference']} on {d['question_id']} "
                      f"turn {d['turn'] + 1} at token {d['position']}")


def markdown(rows: list[dict[str, Any]], divergent: list[dict[str, Any]], header: str = "") -> str:
    lines = [header] if header else []
    columns = shown(rows)
    for temperature in temperatures(rows):
        lines += [f"## Temperature {temperature:g}", "", "| " + " | ".join(h for _, h, _ in columns) + " |",
                  "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(r[k], f) for k, _, f in columns) + " |"
                  for r in rows if r["temperature"] == temperature]
        lines.append("")
    lines += ["## Divergence from plain decoding (DRAFTER+V vs ar:V)", ""]
    if divergent:
        lines += [f"- **{d['method']}** differs from {d['reference']} on {d['question_id']} turn {d['turn'] + 1} "
                  f"at token {d['position']}" for d in divergent]
    else:
        lines.append("none: every greedy speculative answer, and every sampled ngram / suffix one, matched its "
                     "plain-decoding reference token for token")
    return "\n".join(lines) + "\n"


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    """summary.json (everything) and summary.md (the tables and divergences), each written atomically."""
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    header = "# quasar bench summary\n\n" + "\n".join(f"- {k}: {v}" for k, v in summary["config"].items()) + "\n"
    header += "".join(f"- failed: {method} stopped at {error}\n" for method, error in summary.get("failed", {}).items())
    atomic_write_text(out / "summary.md", markdown(summary["rows"], summary["divergences"], header))
