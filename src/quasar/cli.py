"""`quasar` command line: subcommand dispatch only; each subcommand lives in quasar/commands/ and is imported
only when it runs (as mlx-lm's cli.py), so `quasar --help` and `quasar generate` load no bench, eval or server code."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from quasar.commands.common import UsageError
from quasar.files import use_cache_dir
from quasar.version import __version__

COMMANDS = {  # name -> one-line help; quasar.commands.<name> (with register(subparsers)) is imported only to run it
    "generate": "generate text from a prompt",
    "chat": "chat with a model in the terminal",
    "eval": "task accuracy of float vs quantized verifiers",
    "bench": "benchmark methods side by side (speedup, mean accepted tokens, plots)",
    "serve": "serve a model behind an OpenAI-compatible HTTP API",
    "models": "install and list the bigger named models",
    "data": "fetch the benchmark, evaluation and calibration data into the cache",
    "export": "export the W8A8 model for vLLM (compressed-tensors)",
    "quantize": "quantize a model to W8A8 (SmoothQuant), W4A8 or W8A16 and save it",
    "fidelity": "compare quantized verifiers with the float model (KL, top-1, perplexity)",
}
RUNS_MODELS = {"generate", "chat", "eval", "bench", "serve", "quantize", "fidelity"}  # these compile the kernels ahead


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage is one --help away); subcommand parsers inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"quasar: error: {message} (see `{self.prog} --help`)\n")


def chosen(argv: Sequence[str]) -> str | None:
    """The subcommand argv names: its first word that is not an option (quasar's own options take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with `command` registered in full; the other subcommands are only listed by --help."""
    parser = Parser(
        prog="quasar",
        description="Fast LLM inference by speculative decoding with a quantized (W8A8) verifier.",
    )
    parser.add_argument("--version", action="version", version=f"quasar {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, summary in COMMANDS.items():
        if name == command:
            importlib.import_module(f"quasar.commands.{name}").register(sub)
        else:
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(chosen(argv)).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="quasar: %(message)s")
    chosen_cache = getattr(args, "cache_dir", None)  # the commands that take --cache-dir
    previous = use_cache_dir(chosen_cache) if chosen_cache else None
    try:
        if args.command in RUNS_MODELS:  # a first run compiles the kernels while it fetches and converts the model
            from quasar.kernels.native import compile_ahead

            compile_ahead()
        return args.run(args) or 0
    except KeyboardInterrupt:
        print("quasar: interrupted", file=sys.stderr)
        return 130
    except UsageError as e:  # bad input the parser could not see: argparse's status
        print(f"quasar: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # bad input (ModelLoadError too): one clear line, no traceback
        print(f"quasar: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug: name it in one line; -v shows where
        if args.verbose:
            raise
        first_line = next(iter(str(e).splitlines()), "")
        print(f"quasar: error: unexpected {type(e).__name__}: {first_line} (`quasar -v ...` shows the traceback)",
              file=sys.stderr)
        return 1
    finally:
        if chosen_cache:
            use_cache_dir(previous)
