"""Soak and fault check of `quasar serve` on loopback (docs/serving.md): many streaming clients for minutes, half
of them hanging up at random points, plus a stream of malformed requests and of connections that send nothing or
drip their headers; then SIGKILL mid-load and a restart.

    python bench/soak_serve.py [--clients 64] [--seconds 180] [--max-tokens 64] [--out DIR]

Every finished greedy answer must equal the same request sent alone before the load (texts compared), no
response may be a 5xx, every malformed request must get a 4xx, `/health` must answer 200 within 2 s all along
and at the end, and the server's resident memory must come back within 10% of its idle figure. Reported:
clients, duration, requests finished / hung up / refused (429), time to first token p50 / p99, the slowest
`/health`, RSS idle / peak / after, and the checks.
Writes DIR/soak.json. Nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

KEY = "soak-key"
MODEL = "default"
READ_TIMEOUT = 10  # the server's --read-timeout: silent and dripping connections are closed after it
SILENT_PER_SECOND = 5  # connections opened each second that never send a byte
MALFORMED = [  # (body bytes, what it tests)
    (b"{not json", "bad JSON"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, "temprature": 0}).encode(), "unknown field"),
    (b'{"model": "default", "prompt": "a\\ud800", "max_tokens": 4}', "lone surrogate"),
    (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 10**9}).encode(), "max_tokens beyond the context"),
    (json.dumps({"model": MODEL, "prompt": "hi", "tools": [{"type": "function"}]}).encode(), "tools"),
    (json.dumps({"model": MODEL, "prompt": "hi", "top_k": 2**63}).encode(), "top_k out of range"),
    (json.dumps({"model": MODEL, "prompt": "x" * 5_000_000}).encode(), "body over --max-body"),
    (json.dumps({"model": MODEL, "prompt": "hi", "stop": ["s"] * 100}).encode(), "100 stop strings"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log
        argv = [sys.executable, "-m", "quasar", "serve", "--model", MODEL, "--verifier", "w8a8", "--drafter", "ngram",
                "--served-model-name", MODEL, "--port", str(port), "--max-batch", "16", "--max-queue", "256",
                "--read-timeout", str(READ_TIMEOUT)]
        self.proc = subprocess.Popen(argv, stdout=log.open("a"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "QUASAR_API_KEY": KEY})
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {log}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("the server did not become ready")

    def get(self, path: str) -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", headers={"Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def rss(self) -> float:
        text = self.get("/metrics")[1]
        return float(re.search(r"^quasar_resident_memory_bytes (\S+)$", text, re.MULTILINE).group(1)) / 2**20

    def post(self, body: bytes, timeout: float = 120) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/chat/completions" if b'"messages"' in body else "/v1/completions", body,
                         {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read().decode(errors="replace")
        finally:
            conn.close()

    def stream(self, prompt: str, max_tokens: int, hang_up_after: int | None) -> dict:
        """One streaming chat request: its text, time to first token and status; closed after `hang_up_after`
        chunks when given."""
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                           "temperature": 0, "stream": True}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        start = time.perf_counter()
        try:
            conn.request("POST", "/v1/chat/completions", body,
                         {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                return {"status": response.status}
            text, first, chunks = "", None, 0
            for line in response:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return {"status": 500, "error": data["error"]}
                for choice in data.get("choices", []):
                    piece = choice.get("delta", {}).get("content") or ""
                    if piece and first is None:
                        first = time.perf_counter() - start
                    text += piece
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    return {"status": 200, "hung_up": True, "ttft": first}
            return {"status": 200, "text": text, "ttft": first}
        finally:
            conn.close()


def open_or_close(s: socket.socket) -> bool:
    """Whether the server still holds this silent connection open (closed here once the server closed it)."""
    try:
        if s.recv(1024, socket.MSG_DONTWAIT) is not None:  # b'' or a 408: the server closed it
            s.close()
            return False
    except BlockingIOError:
        return True
    except OSError:
        s.close()
        return False
    return True


def quietly(call, *args) -> None:
    """call(*args) where the server may vanish under it (the SIGKILL step)."""
    try:
        call(*args)
    except (OSError, http.client.HTTPException, ValueError):
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="quasar-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    from quasar.tools.bench.suites import load_suite

    prompts = [item.turns[0][:1500] for item in load_suite("quick")]
    server = Server(free_port(), out / "server.log")
    reference = {p: server.stream(p, args.max_tokens, None)["text"] for p in prompts}  # each alone, before the load
    time.sleep(2)
    idle = server.rss()
    results: list[dict] = []
    malformed: list[tuple[str, int]] = []
    peak = [idle]
    health_s: list[float] = []
    silent_opened = [0]
    stop_at = time.monotonic() + args.seconds
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < stop_at:
            prompt = rng.choice(prompts)
            hang_up = rng.randint(1, args.max_tokens // 2) if i % 2 else None
            result = server.stream(prompt, args.max_tokens, hang_up) | {"prompt": prompt}
            with lock:
                results.append(result)

    def hostile() -> None:
        while time.monotonic() < stop_at:
            for body, what in MALFORMED:
                try:
                    status = server.post(body)[0]
                except OSError:  # the server answered 413 and closed while the large body was still going out
                    status = 413 if len(body) > 1_000_000 else 0
                with lock:
                    malformed.append((what, status))
                time.sleep(0.5)

    def slow() -> None:  # connections that send nothing, and one that drips its headers a byte a second
        held: list[socket.socket] = []
        drip = socket.create_connection(("127.0.0.1", server.port))
        header = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: y\r\n" * 1000
        for i in range(int(args.seconds)):
            held += [socket.create_connection(("127.0.0.1", server.port)) for _ in range(SILENT_PER_SECOND)]
            silent_opened[0] += SILENT_PER_SECOND
            try:
                drip.sendall(header[i : i + 1])
            except OSError:  # closed by the server: start another
                drip.close()
                drip = socket.create_connection(("127.0.0.1", server.port))
            held = [s for s in held if open_or_close(s)]
            time.sleep(1)
        for s in [*held, drip]:
            s.close()

    def watch() -> None:
        while time.monotonic() < stop_at:
            peak[0] = max(peak[0], server.rss())
            started = time.perf_counter()
            status = server.get("/health")[0]
            health_s.append(time.perf_counter() - started if status == 200 else float("inf"))
            time.sleep(1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    threads += [threading.Thread(target=hostile), threading.Thread(target=watch), threading.Thread(target=slow)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(15)  # idle: the server gives back what the load kept (after 5 s idle)
    after = server.rss()
    health = server.get("/health")[0]
    normal = server.stream(prompts[0], args.max_tokens, None)
    finished = [r for r in results if r["status"] == 200 and not r.get("hung_up")]
    mismatched = [r["prompt"][:40] for r in finished if r["text"] != reference[r["prompt"]]]
    ttfts = sorted(r["ttft"] for r in results if r.get("ttft") is not None)
    report = {
        "clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens,
        "finished": len(finished), "hung_up": sum(bool(r.get("hung_up")) for r in results),
        "refused_429": sum(r["status"] == 429 for r in results),
        "server_errors": sum(r["status"] >= 500 for r in results),
        "mismatched_answers": mismatched,
        "malformed": len(malformed), "malformed_not_4xx": sorted({w for w, s in malformed if not 400 <= s < 500}),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        "silent_connections": silent_opened[0], "health_slowest_s": round(max(health_s, default=0.0), 3),
        "rss_idle_mb": round(idle), "rss_peak_mb": round(peak[0]), "rss_after_mb": round(after),
        "health_after": health, "normal_request_after": normal.get("text") == reference[prompts[0]],
    }
    load = [threading.Thread(target=quietly, args=(server.stream, p, args.max_tokens, None)) for p in prompts[:4]]
    for t in load:
        t.start()
    time.sleep(1.0)
    server.proc.send_signal(signal.SIGKILL)  # mid-load: a restart must come up clean and answer as before
    server.proc.wait()
    for t in load:
        t.join()
    restarted = Server(server.port, out / "server.log")
    report["restart_after_sigkill"] = restarted.stream(prompts[0], args.max_tokens, None).get("text") == reference[prompts[0]]
    restarted.proc.send_signal(signal.SIGTERM)
    report["exit_after_sigterm"] = restarted.proc.wait(timeout=60)
    report["ok"] = (not report["server_errors"] and not mismatched and not report["malformed_not_4xx"]
                    and health == 200 and report["health_slowest_s"] < 2 and report["normal_request_after"] and after <= 1.1 * idle
                    and report["restart_after_sigkill"] and report["exit_after_sigterm"] == 0)
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"written: {out / 'soak.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
