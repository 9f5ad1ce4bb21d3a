"""`quasar` command line: subcommand dispatch only; each subcommand lives in quasar/commands/."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from quasar import __version__

COMMANDS = ("generate", "eval", "bench", "serve", "models", "export", "quantize", "fidelity")  # modules in quasar.commands, each with register(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quasar",
        description="Fast LLM inference by speculative decoding with a quantized (W8A8) verifier.",
    )
    parser.add_argument("--version", action="version", version=f"quasar {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"quasar.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="quasar: %(message)s")
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        print("quasar: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # bad input (ModelLoadError too): one clear line, no traceback
        print(f"quasar: error: {e}", file=sys.stderr)
        return 1
