"""`quasar serve`: the OpenAI-compatible HTTP server, or the equivalent `vllm serve` command (--engine vllm)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from quasar.commands.common import (
    add_decode_args,
    add_model_args,
    build_engine,
    engine_spec,
    port,
    positive_float,
    positive_int,
)

if TYPE_CHECKING:
    from quasar.decoding.engine import Engine
    from quasar.spec import VerifierSpec

log = logging.getLogger("quasar")
FLOAT_KINDS = ("fp32", "bf16")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve", help="serve a model behind an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. Concurrent "
        "requests are batched continuously: up to --max-batch of them share every forward of the model (each "
        "gets the tokens it would get alone), joining and leaving between steps; more wait in a bounded queue.",
    )
    add_model_args(parser)
    add_decode_args(parser)
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    net.add_argument("--port", type=port, default=8000, help="port (default: %(default)s)")
    net.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health; other local "
                     "users see it in `ps`: prefer $QUASAR_API_KEY or --api-key-file (default: $QUASAR_API_KEY)")
    net.add_argument("--api-key-file", help="read the API key from this file (its first line)")
    net.add_argument("--max-body", type=positive_int, default=4_000_000,
                     help="largest request body in bytes; larger ones get HTTP 413 before they are read (default: "
                     "%(default)s)")
    net.add_argument("--read-timeout", type=positive_float, default=30.0,
                     help="seconds a client has to send a request's headers, and then its body; a connection that "
                     "stays silent that long is closed, a late body gets HTTP 408 (default: %(default)s)")
    net.add_argument("--allow-special-tokens", action="store_true",
                     help="encode a control token's text in a prompt or message (e.g. <|im_start|>) as that control "
                     "token; by default it is plain text, so a message cannot close its turn and forge another (a system turn, say)")
    net.add_argument("--max-connections", type=positive_int,
                     help="open connections at most; past it a new one closes the idle one quiet longest, or gets HTTP "
                     "503 when none is idle (default: what the open-file limit allows, at most 1024)")
    net.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="on SIGTERM or Ctrl-C, seconds the running requests get to finish before they are ended; "
                     "new ones get HTTP 503 meanwhile; a second signal exits at once (default: %(default)s)")
    net.add_argument("--max-queue", type=positive_int, default=64,
                     help="requests that may wait for a place in the batch; more get HTTP 429 (default: %(default)s)")
    net.add_argument("--max-batch", type=positive_int, default=16,
                     help="requests generated at once, sharing each forward (default: %(default)s; 1 = one at a time)")
    net.add_argument("--max-batch-tokens", type=positive_int, default=64,
                     help="rows (tokens) one forward may hold: every request's next token, then draft tokens and "
                     "prompt chunks while they fit (default: %(default)s)")
    net.add_argument("--kv-budget", type=positive_int,
                     help="KV cache positions all running requests may hold together (each reserves its prompt plus "
                     "max_tokens, or the context when it gives none, but takes memory only for the positions it "
                     "uses); requests wait until theirs fits (default: what half the memory free once the model is "
                     "loaded holds)")
    net.add_argument("--served-model-name", help="the model id clients send (default: the --model value)")
    hand = parser.add_argument_group("vLLM hand-off")
    hand.add_argument("--engine", choices=("quasar", "vllm"), default="quasar",
                      help="'vllm' starts `vllm serve` with the same model and drafter settings (default: %(default)s)")
    hand.add_argument("--dry-run", action="store_true", help="with --engine vllm: print the command, do not start it")
    hand.add_argument("--vllm", default="vllm", help="the vllm executable, e.g. in its own virtualenv (default: %(default)s)")
    hand.add_argument("--export-dir", help="with --engine vllm and a quantized verifier: where to write the "
                      "compressed-tensors export (default: in the cache directory)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    name = args.served_model_name or str(args.model)
    if args.engine == "vllm":
        return hand_off(args, name)
    import functools
    import signal
    import threading

    import uvicorn

    from quasar.serve.app import create_app
    from quasar.serve.connections import GuardedH11Protocol, OncePerInterval, connection_limits

    key = api_key(args)
    if key is None and args.host not in LOOPBACK:
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model "
                    "(set QUASAR_API_KEY or --api-key-file)", args.host)
    engine = build_engine(args)
    app = create_app(engine, name, api_key=key, max_queue=args.max_queue, max_batch=args.max_batch,
                     max_rows=args.max_batch_tokens, kv_budget=args.kv_budget or default_kv_budget(engine),
                     own_thread=False, max_body=args.max_body, read_timeout=args.read_timeout,
                     allow_special_tokens=args.allow_special_tokens)
    # Generation runs on this thread, the one that loaded the model (Scheduler.work says why); HTTP on another,
    # with a short GIL switch interval so that streamed tokens leave as soon as they are made.
    sys.setswitchinterval(0.0005)
    limits = connection_limits(args.max_connections)
    protocol = functools.partial(GuardedH11Protocol, read_timeout=args.read_timeout, max_connections=limits.connections)
    http = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", http=protocol,
                                         backlog=limits.backlog, timeout_graceful_shutdown=5))
    logging.getLogger("asyncio").addFilter(OncePerInterval())

    signals = []

    def shut_down(number: int, _: object) -> None:
        """The first signal drains (503 for new requests, the running ones get --shutdown-timeout seconds); a
        second one exits at once."""
        signals.append(number)
        if len(signals) > 1:
            print("quasar: second signal, exiting now", file=sys.stderr, flush=True)
            os._exit(128 + number)
        print(f"quasar: shutting down: running requests get {args.shutdown_timeout:g} s to finish (a second signal "
              "exits at once)", file=sys.stderr, flush=True)
        app.state.scheduler.drain(args.shutdown_timeout)

    def serve_http() -> None:
        try:
            http.run()
        finally:  # stopped, or it could not start (the port is taken): generation stops too
            app.state.scheduler.stop()

    signal.signal(signal.SIGTERM, shut_down)
    signal.signal(signal.SIGINT, shut_down)
    server_thread = threading.Thread(target=serve_http, name="quasar-http", daemon=True)
    server_thread.start()

    def announce() -> None:  # once the port is bound: a failed bind says only why
        while server_thread.is_alive() and not http.started:
            time.sleep(0.05)
        if http.started:
            print(f"quasar: serving {name!r} on http://{args.host}:{args.port}/v1 (pid {os.getpid()})", file=sys.stderr,
                  flush=True)

    threading.Thread(target=announce, name="quasar-announce", daemon=True).start()
    app.state.scheduler.work()  # until drained or stopped (or the worker failed: HTTP then answers 503 until stopped)
    if signals:  # drained: the last events reach their clients, then HTTP stops
        time.sleep(0.2)
        http.should_exit = True
    while server_thread.is_alive():
        server_thread.join(timeout=1.0)
    if not http.started:
        raise ValueError(f"could not serve on {args.host}:{args.port} (see the error above)")
    return 0


LOOPBACK = ("127.0.0.1", "localhost", "::1")
KV_MEMORY_SHARE = 0.5  # of the memory free once the model is loaded: what the KV caches may take by default


def default_kv_budget(engine: Engine) -> int | None:
    """The KV positions half the free memory holds (at least one bucket; None where free memory is unknown)."""
    from quasar.decoding.engine import CACHE_BUCKET
    from quasar.machine import available_bytes

    free = available_bytes()
    if free is None:
        return None
    one = engine.caches.model.new_cache(1)
    per_position = one.k.numel() * one.k.element_size() + one.v.numel() * one.v.element_size()
    positions = max(CACHE_BUCKET, int(free * KV_MEMORY_SHARE / per_position) // CACHE_BUCKET * CACHE_BUCKET)
    print(f"quasar: KV budget {positions:,} positions ({positions * per_position / 2**30:.1f} GiB, half the free "
          "memory; --kv-budget sets it)", file=sys.stderr, flush=True)
    if positions < engine.max_context:
        log.warning("the KV budget holds less than one request of the whole context (%d tokens): longer requests are "
                    "refused", engine.max_context)
    return positions


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $QUASAR_API_KEY, else None (no key)."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().splitlines()[0].strip()
        except (OSError, IndexError) as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read a key ({e})") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file}: the first line is empty")
        return key
    return os.environ.get("QUASAR_API_KEY") or None


def hand_off(args: argparse.Namespace, name: str) -> int:
    """Build the `vllm serve` command for the same model; print it (--dry-run) or replace this process by it."""
    from quasar.decoding.drafters.base import DrafterOptions
    from quasar.serve.vllm import VllmServe, vllm_command

    spec = engine_spec(args)
    if spec.guard is not None:
        raise ValueError("--guard runs on quasar's engine; the vLLM hand-off does not take it")
    if spec.middle is not None:
        raise ValueError(f"the vLLM hand-off serves one model; the cascade {spec.verifier_name} (--exact) runs on "
                         "quasar's engine")
    model_dir, dtype = vllm_model(args.model, spec.top, args.export_dir)
    serve = VllmServe(model_dir, name, dtype, args.host, args.port, api_key(args), args.max_context, args.vllm)
    argv = vllm_command(serve, spec, DrafterOptions(args.ngram_min, args.ngram_max))
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    if shutil.which(args.vllm) is None:
        raise ValueError(f"{args.vllm!r} not found; install vLLM in its own environment and pass --vllm PATH")
    os.execvp(argv[0], argv)
    return 0  # not reached


def vllm_model(model: str, verifier: VerifierSpec, export_dir: str | None) -> tuple[Path, str]:
    """The directory vLLM should load and the dtype of its float parts."""
    from quasar.builder import model_source
    from quasar.model.loading import cache_root, float_directory
    from quasar.verifiers.registry import fitting, load_verifier

    source = model_source(model)
    verifier = fitting(verifier, source)

    if verifier.kind in FLOAT_KINDS:  # the float Hugging Face directory, without loading the weights
        return float_directory(source), {"fp32": "float32", "bf16": "bfloat16"}[verifier.kind]
    if verifier.kind != "w8a8":
        raise ValueError(f"the vLLM hand-off supports --verifier fp32, bf16 or w8a8, not {verifier}")
    from quasar.tools.export import export, vllm_scheme

    verifier, note = vllm_scheme(verifier)
    if note:
        print(f"quasar: {note}", file=sys.stderr)
    target = load_verifier(source, verifier, owned=False)  # the export reads the plain layout
    name = str(verifier).replace(":", "-")
    out = Path(export_dir) if export_dir else cache_root() / "exports" / f"{target.source_sha256}-{name}-ct"
    if not (out / "config.json").exists():
        export(target, out)
    return out, "float32" if str(target.model.dtype) == "torch.float32" else "bfloat16"
