"""`quasar export`: write a quantized model in a layout other engines load (compressed-tensors for vLLM)."""

from __future__ import annotations

import argparse
import sys

from quasar.commands.common import add_model_args, verifier_spec


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "export", help="export the W8A8 model for vLLM (compressed-tensors)",
        description="Write the quantized verifier in the compressed-tensors int8 layout that llm-compressor "
        "produces and vLLM loads: int8 per-channel weights + weight_scale, dynamic per-token int8 activations, "
        "lm_head left in float. vLLM has no kernel for quasar's group-wise scales (w8a8 = w8a8:g32), so a "
        "grouped --verifier exports its nearest per-channel scheme (w8a8:pc), and says so. The directory is "
        "written atomically.",
    )
    add_model_args(parser, verifier_default="w8a8")
    parser.add_argument("--format", choices=("compressed-tensors",), default="compressed-tensors",
                        help="(default: %(default)s)")
    parser.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from quasar.tools.export import export, vllm_scheme
    from quasar.verifiers.registry import load_verifier

    verifier, note = vllm_scheme(verifier_spec(args))
    if note:
        print(f"quasar: {note}", file=sys.stderr)
    target = load_verifier(args.model, verifier, owned=False)  # the export reads the plain layout
    out = export(target, args.out, args.format)
    print(f"quasar: wrote {out}", file=sys.stderr)
    return 0
