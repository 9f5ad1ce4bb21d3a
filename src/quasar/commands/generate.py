"""`quasar generate`: stream a completion of one prompt to stdout."""

from __future__ import annotations

import argparse
import json
import sys

from quasar.commands.common import (
    add_decode_args,
    add_model_args,
    add_sampling_args,
    add_structure_args,
    build_engine,
    prompt,
    read_prompt,
    sampling_params,
)
from quasar.decoding.stats import GenerationStats


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "generate", help="generate text from a prompt",
        description="Generate a completion of PROMPT and stream it to stdout; a line on standard error then says "
        "what it cost (tokens/s, the prompt's share, tokens per verify step) and which kernel paths computed it.",
    )
    parser.add_argument("prompt", nargs="?", metavar="PROMPT", type=prompt,
                        help="the prompt; '-' reads it from standard input")
    add_model_args(parser)
    add_decode_args(parser)
    add_sampling_args(parser)
    add_structure_args(parser)
    chat = parser.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the model's chat template (default when the model has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="use the prompt as raw text")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats, path) instead of streaming")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    text = read_prompt(args.prompt)
    engine = build_engine(args)
    request = engine.run(engine.encode(text, args.chat), params)
    if args.json:
        print(json.dumps({**request.result().to_dict(), "path": engine.path}))
        return 0
    for piece in request:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(summary(request.output.stats, engine.path), file=sys.stderr)  # stdout keeps the text alone
    return 0


def summary(stats: GenerationStats, path: str) -> str:
    """One line on what the completion cost and what computed it, e.g. '24 tokens in 0.81 s, 29.6 tokens/s (prompt:
    12 tokens in 0.05 s; 1.62 tokens a verify step) on kernels:dpbusd'."""
    parts = [f"prompt: {stats.prompt_tokens} tokens in {stats.prefill_s:.2f} s"]
    if stats.proposed_tokens:
        forced = f", {stats.forced_per_step:.2f} of them forced by the grammar" if stats.forced_tokens else ""
        parts.append(f"{stats.mean_accepted_tokens:.2f} tokens a verify step{forced}")
    return (f"{stats.new_tokens} tokens in {stats.wall_s:.2f} s, {stats.tokens_per_s:.1f} tokens/s "
            f"({'; '.join(parts)}) on {path}")
