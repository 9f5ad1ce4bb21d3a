"""`quasar bench`: every method side by side on the packaged suites; tables, JSON and plots."""

from __future__ import annotations

import argparse
import sys

from quasar.tools.bench.base import MethodOptions
from quasar.tools.bench.report import print_summary
from quasar.tools.bench.runner import RunConfig
from quasar.tools.bench.session import BenchOptions, bench
from quasar.tools.bench.suites import CATEGORIES, SUITE_SIZES
from quasar.commands.common import positive_int, seed, temperature, tree_width

SUITE_TOKENS = {"quick": 32, "spec": 256, "full": 256}  # default --max-new-tokens per suite


def csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def temperatures(text: str) -> tuple[float, ...]:
    return tuple(temperature(t) for t in csv(text))


def draft_length(text: str) -> int | str:
    if text != "auto" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"--k must be a positive integer or 'auto', got {text!r}")
    return text if text == "auto" else int(text)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench", help="benchmark methods side by side (speedup, mean accepted tokens, plots)",
        description="Run every method on the same prompts, interleaved, and report tokens/s, mean accepted "
        "tokens, acceptance rate and speedups per category, as a table, summary.md, summary.json and PNG plots.",
    )
    parser.add_argument("--suite", choices=tuple(SUITE_SIZES), default="quick",
                        help="quick: 1 prompt per category; spec: 80 per category where the data has them "
                        "(Spec-Bench's shape); full: everything (default: %(default)s)")
    parser.add_argument("--model", default="default", help="'default', a .gguf file or a model directory")
    parser.add_argument("--methods", type=csv,
                        help="comma-separated: ar:V, DRAFTER+V (ngram+gguf, ngram+bf16, model:PATH+w8a8, ...), hf:ar, "
                        "hf:pld, llamacpp:ar, llamacpp:pld[:f16|:file] (llama.cpp on a Q8_0 copy, an F16 copy or the "
                        "model's own GGUF) (default: on a quantized GGUF such as the default model, ar:gguf,ngram+gguf "
                        "(its own blocks: no float copy, no calibration); on a float model, "
                        "ar:bf16,ngram+bf16,ar:w8a8,ngram+w8a8)")
    parser.add_argument("--temperatures", type=temperatures, default="0", help="comma-separated (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=positive_int, help="token budget per turn (default: 32 quick, 256 otherwise)")
    parser.add_argument("--limit", type=positive_int, help="prompts per category (default: the suite's)")
    parser.add_argument("--categories", type=csv, help=f"only these categories, from: {', '.join(CATEGORIES)}")
    parser.add_argument("--k", type=draft_length, default="auto",
                        help="draft length for DRAFTER+V: a number (the paper: 5) or 'auto', chosen from the acceptance "
                        "and the measured step costs as generate's (default: %(default)s)")
    parser.add_argument("--tree", type=tree_width, default="1", metavar="WIDTH",
                        help="candidates per position of DRAFTER+V's draft trees: 1 (one chain) to 4, or 'auto' as "
                        "generate's (default: %(default)s)")
    parser.add_argument("--seed", type=seed, default=0, help="base seed for sampled runs (default: 0)")
    parser.add_argument("--repeat", type=positive_int, default=1, metavar="N",
                        help="answer each prompt N times with every method, interleaved, and keep each method's "
                             "answer of median time: steadier ratios on a noisy machine (default: 1)")
    parser.add_argument("--out", default="bench-out", help="output directory, replaced as a whole when the run ends "
                        "(default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace the earlier run in a non-empty --out")
    parser.add_argument("--quantized", metavar="DIR", help="a checkpoint from `quasar quantize` to use as the "
                        "w8a8 (or w8a16) verifier, instead of quantizing --model on the fly")
    parser.add_argument("--cache-dir", help="where converted and quantized models are cached")
    parser.add_argument("--max-context", type=positive_int, help="context window in tokens (default: the model's)")
    parser.add_argument("--no-memory-wall", dest="memory_wall", action="store_false",
                        help="skip the bandwidth probe and the verify-forward curves")
    parser.add_argument("--no-plots", dest="plots", action="store_false", help="write no PNG plots")
    parser.set_defaults(run=run)


def options(args: argparse.Namespace) -> BenchOptions:
    max_new = args.max_new_tokens or SUITE_TOKENS[args.suite]
    return BenchOptions(
        suite=args.suite, methods=args.methods, out=args.out, per_category=args.limit, categories=args.categories,
        run=RunConfig(temperatures=args.temperatures, max_new_tokens=max_new, seed=args.seed, repeat=args.repeat),
        model=MethodOptions(model=args.model, max_context=args.max_context,
                            k=args.k, tree=args.tree, quantized=args.quantized),
        memory_wall=args.memory_wall, plots=args.plots, overwrite=args.overwrite,
    )


def run(args: argparse.Namespace) -> int:
    result, summary = bench(options(args))
    print_summary(summary["rows"], summary["divergences"], summary["config"]["machine"])
    for method, error in summary["failed"].items():
        print(f"failed: {method} stopped at {error}", file=sys.stderr)
    print(f"wrote {args.out}/summary.md, summary.json, answers.jsonl" + (" and plots" if summary.get("plots") else ""))
    return 130 if result.interrupted else 0
