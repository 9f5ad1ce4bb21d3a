"""`quasar generate`: stream a completion of one prompt to stdout."""

from __future__ import annotations

import argparse
import json
import sys

from quasar.commands.common import (
    add_decode_args, add_model_args, add_sampling_args, decode_config, read_prompt, sampling_params, verifier_name,
)


DEFAULT_VERIFIER = "w8a8"  # the paper's setup: --drafter ngram --verifier w8a8


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "generate", help="generate text from a prompt",
        description="Generate a completion of PROMPT and stream it to stdout.",
    )
    parser.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt; '-' reads it from standard input")
    add_model_args(parser, verifier_default=DEFAULT_VERIFIER)
    add_decode_args(parser)
    add_sampling_args(parser)
    chat = parser.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the model's chat template (default when the model has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="use the prompt as raw text")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats) instead of streaming")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from quasar.api import build_engine

    params = sampling_params(args)
    prompt = read_prompt(args.prompt)
    engine = build_engine(args.model, verifier_name(args), decode_config(args), args.max_context, args.cache_dir)
    request = engine.run(engine.encode(prompt, args.chat), params)
    if args.json:
        print(json.dumps(request.result().to_dict()))
        return 0
    for piece in request:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
