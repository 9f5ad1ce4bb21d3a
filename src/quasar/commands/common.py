"""Options shared by the subcommands that take a model and sampling settings, and the argparse types that refuse
bad numbers while parsing. Light to import: `quasar --help` and argument parsing load no model code."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from quasar.decoding.sampling import SamplingParams
    from quasar.spec import EngineSpec, VerifierSpec

N = TypeVar("N", int, float)


def checked(kind: Callable[[str], N], ok: Callable[[N], bool], what: str) -> Callable[[str], N]:
    """An argparse type: `kind(text)` when `ok` holds, else argparse's one-line error saying `what` was expected."""

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int = checked(int, lambda n: n >= 1, "a positive integer")
positive_float = checked(float, lambda x: 0 < x < math.inf, "a positive number")
port = checked(int, lambda n: 0 <= n <= 65535, "a port number from 0 to 65535")
temperature = checked(float, lambda t: 0 <= t < math.inf, "a finite temperature >= 0")
top_p = checked(float, lambda p: 0 < p <= 1, "a nucleus mass in (0, 1]")
top_k = checked(int, lambda k: k >= 0, "an integer >= 0 (0 keeps every token)")
min_p = checked(float, lambda p: 0 <= p <= 1, "a fraction in [0, 1]")


class UsageError(ValueError):
    """Bad input the parser could not see (an empty prompt read from standard input, ...): exit status 2, as
    argparse's own errors."""


def from_spec(check: Callable[[str], object], what: str) -> Callable[[str], str]:
    """An argparse type that runs one of quasar.spec's checks on the text and keeps the text."""

    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def drafter(text: str) -> str:
    from quasar.spec import check_drafter

    return from_spec(check_drafter, "drafter")(text)


def draft_length(text: str) -> str:
    from quasar.spec import parse_k

    return from_spec(parse_k, "k")(text)


def tree_width(text: str) -> str:
    from quasar.spec import parse_tree

    return from_spec(parse_tree, "tree")(text)


def verifier(text: str) -> str:
    from quasar.spec import parse_levels

    return from_spec(parse_levels, "verifier")(text)


def prompt(text: str) -> str:
    """The PROMPT argument: text, or '-' for standard input; never empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the prompt is empty; pass some text, or '-' to read it from standard input")
    return text


def seed(text: str) -> int:
    """An argparse type: a seed in the range SamplingParams (torch) accepts."""
    from quasar.decoding.sampling import check_seed

    value = checked(int, lambda n: True, "an integer")(text)
    try:
        check_seed(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_model_args(parser: argparse.ArgumentParser, verifier_default: str = "auto") -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model", default="default",
        help="'default' (the embedded SmolLM2-135M-Instruct), a .gguf file, a Hugging Face model directory "
        "or a quantized directory made by `quasar quantize` (default: %(default)s)",
    )
    group.add_argument(
        "--verifier", default=verifier_default, type=verifier,
        help="precision of the target/verifier model: auto (a quantized GGUF's own blocks, as llama.cpp runs the file; "
        "W8A8 for a float model; a `quasar quantize` directory's own scheme), gguf (a GGUF file's own blocks), fp32, "
        "bf16, w8a8 (SmoothQuant int8, calibrated once and cached), w8a16, w4a8:gN (4-bit blocks fitted to the float "
        "weights; plain w4a8 is gguf on a GGUF file), pruned:N, or a cascade MIDDLE+TOP such as w8a8+bf16 (MIDDLE "
        "drafts for TOP; the output is TOP's) (default: %(default)s)",
    )
    group.add_argument("--dtype", choices=("fp32", "bf16"), help="shorthand for --verifier fp32|bf16")
    group.add_argument("--cache-dir", help="where converted GGUF and quantized models are cached "
                       "(default: $XDG_CACHE_HOME/quasar or ~/.cache/quasar)")
    group.add_argument("--max-context", type=positive_int, help="context window in tokens (default: the model's)")


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    """--verifier (or --dtype), --drafter, --k, --guard, --tree and --exact as one EngineSpec (checked as it is made)."""
    from quasar.spec import EngineSpec, parse_k, parse_levels, parse_tree

    spec = EngineSpec(parse_levels(args.dtype or args.verifier), args.drafter, parse_k(args.k), args.guard,
                      parse_tree(args.tree))
    return spec.exact() if args.exact else spec


def verifier_spec(args: argparse.Namespace) -> VerifierSpec:
    """--verifier (or --dtype) where one model is meant, not a cascade."""
    from quasar.spec import VerifierSpec

    name = args.dtype or args.verifier
    if "+" in name:
        raise ValueError(f"--verifier {name} is a cascade; this command takes one model (e.g. w8a8)")
    return VerifierSpec.parse(name)


def build_engine(args: argparse.Namespace):  # -> quasar.decoding.engine.Engine
    """The engine the model and decoding options name (quasar.builder)."""
    from quasar.builder import Verifiers, build_engine
    from quasar.decoding.drafters.base import DrafterOptions

    options = DrafterOptions(args.ngram_min, args.ngram_max)
    return build_engine(engine_spec(args), Verifiers(args.model), options, args.max_context)


def add_decode_args(parser: argparse.ArgumentParser, drafter_default: str = "ngram") -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--drafter", default=drafter_default, type=drafter,
                       help="none (plain decoding), ngram, suffix, model:PATH (a smaller model with the same "
                       "tokenizer: a .gguf file, a model directory or an installed name), layerskip:N (default: "
                       "%(default)s)")
    group.add_argument("--exact", action="store_true",
                       help="the float (bf16) model's exact output at close to int8 cost: the quantized verifier's "
                       "output drafts for bf16 (the cascade, --verifier w8a8+bf16)")
    group.add_argument("--guard", type=float, metavar="MARGIN",
                       help="approximate: where the verifier's top-1 logit leads the runner-up by less than MARGIN, "
                       "take the float (bf16) model's token instead, scored over the verifier's cache; 0.1 agrees "
                       "with bf16 on ~99.5%% of positions at ~0.9x the speed (docs/cascade.md)")
    group.add_argument("--k", default="auto", type=draft_length, help="draft tokens per verify step, or 'auto': the length that promises the most tokens per second from "
                       "the recent acceptance and the measured cost of each step size, 0 where drafts do not pay "
                       "(default: %(default)s)")
    group.add_argument("--tree", default="1", type=tree_width, metavar="WIDTH",
                       help="candidates per position (ngram, suffix and model drafters): 1 drafts one chain; 2-4 draft "
                       "a tree of up to that many alternatives a position, verified in one forward without changing "
                       "the output's distribution; 'auto': up to 4, as many nodes as the measured step costs and "
                       "acceptance pay for (trees run on the fused CPU kernels; elsewhere one chain) "
                       "(default: %(default)s)")
    group.add_argument("--ngram-min", type=positive_int, default=1, help="shortest n-gram the ngram/suffix drafters match (default: %(default)s)")
    group.add_argument("--ngram-max", type=positive_int, default=3, help="longest n-gram the ngram drafter matches (default: %(default)s)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate at most (default: %(default)s)")
    group.add_argument("--temperature", type=temperature, default=0.0, help="0 is greedy (default: %(default)s)")
    group.add_argument("--top-p", type=top_p, default=1.0, help="nucleus sampling mass in (0, 1] (default: %(default)s)")
    group.add_argument("--top-k", type=top_k, default=0, help="keep the k most likely tokens; 0 keeps all (default: %(default)s)")
    group.add_argument("--min-p", type=min_p, default=0.0,
                       help="drop tokens less likely than this fraction of the most likely one; 0 keeps all (default: %(default)s)")
    group.add_argument("--seed", type=seed, help="random seed; the same seed reproduces the same sample")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")


def structure(kind: str, from_file: bool) -> Callable[[str], str]:
    """An argparse type for a structured-output flag: its text (read from the file it names when `from_file` and
    such a file exists), compiled once to check it (quasar.decoding.grammar): a bad one is exit status 2."""

    def parse(text: str) -> str:
        from pathlib import Path

        from quasar.decoding.grammar import Constraint, GrammarError

        path = Path(text)
        if from_file and len(text) < 4096 and path.is_file():
            text = path.read_text()
        try:
            Constraint(kind, text)
        except GrammarError as e:
            raise argparse.ArgumentTypeError(e.reason) from None
        return text

    parse.__name__ = kind
    return parse


def add_structure_args(parser: argparse.ArgumentParser, only_schema: bool = False) -> None:
    group = parser.add_argument_group("structured output (at most one)").add_mutually_exclusive_group()
    group.add_argument("--json-schema", type=structure("json_schema", from_file=True), metavar="FILE|JSON",
                       help="answer with JSON that validates against this JSON schema (a file, or the JSON itself)")
    if only_schema:
        return
    group.add_argument("--regex", type=structure("regex", from_file=False), metavar="R",
                       help="answer with text that matches this regular expression whole")
    group.add_argument("--grammar", type=structure("grammar", from_file=True), metavar="FILE",
                       help="answer with text this grammar derives (Lark, as llguidance reads it, or llama.cpp's GBNF)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    from quasar.decoding.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
        max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
        json_schema=getattr(args, "json_schema", None), regex=getattr(args, "regex", None),
        grammar=getattr(args, "grammar", None),
    )


def read_prompt(prompt: str | None) -> str:
    """The PROMPT argument, or standard input when it is '-'; an empty one is a UsageError."""
    if prompt is None:
        raise UsageError("no prompt given (pass PROMPT, or '-' to read it from standard input)")
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise UsageError("the prompt read from standard input is empty")
    return text
