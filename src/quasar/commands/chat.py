"""`quasar chat`: a multi-turn conversation in the terminal, streaming, its KV cache kept across turns."""

from __future__ import annotations

import argparse
import signal
import sys

from quasar.commands.common import (
    add_decode_args,
    add_model_args,
    add_sampling_args,
    add_structure_args,
    build_engine,
    sampling_params,
)

HELP = """/reset  forget the conversation (the system message stays)
/stats  what the conversation has cost so far
/help   this list
Ctrl-C stops the current answer (the conversation keeps it); Ctrl-D (or /exit) leaves."""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "chat", help="chat with a model in the terminal",
        description="A multi-turn chat: each answer streams as it is generated, with a line on standard error "
        "saying what it cost. The conversation's KV cache is kept between turns, so a turn processes only its new "
        "tokens. Commands: /reset, /stats, /help; Ctrl-C stops an answer, Ctrl-D leaves.",
    )
    add_model_args(parser)
    add_decode_args(parser)
    add_sampling_args(parser)
    add_structure_args(parser, only_schema=True)
    parser.set_defaults(max_new_tokens=512)
    parser.add_argument("--system", help="a system message that opens the conversation")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from quasar.decoding.conversation import Conversation

    params = sampling_params(args)
    engine = build_engine(args)
    conversation = Conversation(engine, args.system)
    # Ctrl-C is how an answer is stopped, even where the shell started this with SIGINT ignored (`cmd &`)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        import readline  # noqa: F401  (line editing and history for input(), where Python has it)
    except ImportError:
        pass
    print(f"quasar chat on {engine.path}; /help lists the commands, Ctrl-D leaves", file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:  # at the prompt: drop the line, as a shell does
            print(file=sys.stderr)
            continue
        command = text.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            conversation.reset()
            print("(conversation cleared)", file=sys.stderr)
        elif command == "/stats":
            print(totals(conversation), file=sys.stderr)
        elif command in ("/help", "/?"):
            print(HELP, file=sys.stderr)
        elif command.startswith("/"):
            print(f"unknown command {command.split()[0]}; /help lists them", file=sys.stderr)
        else:
            answer(conversation, text, params)


def answer(conversation, text: str, params) -> None:
    """Stream one reply; Ctrl-C stops it where it is and the conversation keeps that much."""
    from quasar.decoding.engine import PromptTooLongError

    reply, stopped = None, False
    try:
        reply = conversation.send(text, params)
        for piece in reply:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except PromptTooLongError as e:
        print(f"{e}; /reset starts a new conversation", file=sys.stderr)
        return
    except KeyboardInterrupt:
        if reply is not None:
            reply.close()
        stopped = True
    sys.stdout.write("\n")
    sys.stdout.flush()
    if reply is None:
        print("[stopped before the answer began]", file=sys.stderr)
    else:
        print(turn_line(reply.output.stats, conversation.engine.path, stopped), file=sys.stderr)


def turn_line(stats, path: str, stopped: bool = False) -> str:
    """'[41 tokens, 28.3 tokens/s, 1.62 tokens a verify step; prompt: 19 new tokens (+73 cached) in 0.04 s; on
    kernels:dpbusd]'."""
    parts = [f"{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s"]
    if stats.proposed_tokens:
        parts[0] += f", {stats.mean_accepted_tokens:.2f} tokens a verify step"
    parts.append(f"prompt: {stats.prompt_tokens - stats.cached_tokens} new tokens (+{stats.cached_tokens} cached) "
                 f"in {stats.prefill_s:.2f} s")
    parts.append(f"on {path}")
    return f"[{'stopped; ' if stopped else ''}{'; '.join(parts)}]"


def totals(conversation) -> str:
    """The conversation so far: turns, tokens in the context, generation and prompt work."""
    stats = [turn.output.stats for turn in conversation.turns]
    new = sum(s.new_tokens for s in stats)
    decode_s = sum(s.wall_s for s in stats)
    prefilled = sum(s.prompt_tokens - s.cached_tokens for s in stats)
    cached = sum(s.cached_tokens for s in stats)
    steps = sum(len(s.accept_lengths) for s in stats)
    emitted = sum(sum(s.accept_lengths) for s in stats)
    lines = [
        f"turns: {len(stats)}; context: {len(conversation.ids)} of {conversation.engine.max_context} tokens",
        f"generated: {new} tokens in {decode_s:.2f} s ({new / decode_s if decode_s else 0:.1f} tokens/s)"
        + (f", {emitted / steps:.2f} tokens a verify step" if steps else ""),
        f"prompts: {prefilled} tokens processed, {cached} reused from the KV cache",
        f"path: {conversation.engine.path}",
    ]
    return "\n".join(lines)
