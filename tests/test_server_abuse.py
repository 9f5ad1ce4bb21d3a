"""`quasar serve` under hostile or careless clients and signals, as a real process on loopback: shutdown drains
and ends cleanly, bad input gets a 4xx naming the field (never a 5xx), bodies are bounded, usage counts what
was returned, the key guards what it should."""

from __future__ import annotations

import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from test_server import KEY, LONG_CONTEXT, MODEL, Server, model_dir  # noqa: F401  (model_dir: a fixture)

openai = pytest.importorskip("openai")
READ_TIMEOUT = 1.5  # the abuse server's --read-timeout


def stream_lines(url: str, body: dict, key: str = KEY, timeout: float = 120) -> list[str]:
    """A streaming request's `data:` payloads, in order, read to the end."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]


def raw_status(server: Server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, Any, dict]:
    request = urllib.request.Request(server.url + path, data=body, method="POST",
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read() or b"{}")


def exits_within(server: Server, seconds: float) -> int | None:
    try:
        return server.proc.wait(timeout=seconds)
    except Exception:  # noqa: BLE001 - TimeoutExpired: the test says so
        return None


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):  # noqa: F811
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "abuse.log", "--api-key", KEY, "--kv-budget", "2048",
                 "--max-body", "1000000", "--read-timeout", str(READ_TIMEOUT), "--max-connections", "16")
    yield srv
    srv.stop()


# ---- shutdown ----------------------------------------------------------------------------------------------


def long_stream(server: Server, tokens: int, out: dict) -> threading.Thread:
    body = {"model": MODEL, "prompt": "a", "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    def read() -> None:
        try:
            out.update(lines=stream_lines(server.url + "/v1/completions", body))
        except (OSError, http.client.HTTPException) as e:  # a server killed mid-stream: the test looks at out
            out.update(error=e)

    thread = threading.Thread(target=read)
    thread.start()
    while server.metrics()["quasar_requests_running"] < 1:
        time.sleep(0.01)
    return thread


@contextmanager
def draining(model_dir: Path, tmp_path: Path, shutdown_timeout: str) -> Iterator[Server]:  # noqa: F811
    """A server for a shutdown test, killed at the end if the test left it running."""
    server = Server(model_dir, tmp_path / "server.log", "--api-key", KEY, "--shutdown-timeout", shutdown_timeout)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.log.close()


def test_sigterm_lets_running_requests_finish_and_refuses_new_ones_with_503(model_dir, tmp_path):  # noqa: F811
    out: dict = {}
    with draining(model_dir, tmp_path, "60") as server:
        stream = long_stream(server, 1500, out)
        os.kill(server.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        status, headers, body = raw_status(server, "/v1/completions",
                                           json.dumps({"model": MODEL, "prompt": "b", "max_tokens": 2}).encode())
        assert status == 503 and "shutting down" in body["error"]["message"]
        stream.join(timeout=120)
        assert out["lines"][-1] == "[DONE]"
        finished = json.loads(out["lines"][-2])
        assert finished["choices"][0]["finish_reason"] == "length"
        assert exits_within(server, 30) == 0


def test_past_the_shutdown_timeout_streams_end_with_an_error_and_done(model_dir, tmp_path):  # noqa: F811
    out: dict = {}
    with draining(model_dir, tmp_path, "1") as server:
        stream = long_stream(server, LONG_CONTEXT - 8, out)
        os.kill(server.proc.pid, signal.SIGTERM)
        stream.join(timeout=60)
        assert out["lines"][-1] == "[DONE]"
        assert "shutting down" in json.loads(out["lines"][-2])["error"]["message"]
        assert exits_within(server, 30) == 0


def test_a_second_signal_exits_at_once(model_dir, tmp_path):  # noqa: F811
    out: dict = {}
    with draining(model_dir, tmp_path, "600") as server:
        long_stream(server, LONG_CONTEXT - 8, out)
        os.kill(server.proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        os.kill(server.proc.pid, signal.SIGINT)
        assert exits_within(server, 10) is not None


# ---- hostile input ----------------------------------------------------------------------------------------


def answer_before_the_body(server: Server, length: int, first: bytes) -> tuple[bytes, bytes]:
    """POST a request's head (Content-Length `length`) and the first bytes of its body, never the rest, and read what
    the server answers until it closes: (status line, body). A client that kept sending a body the server had refused
    would race the server's close (a reset that can drop the answer unread), so none is sent here."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                  b"Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(length).encode() + b"\r\n\r\n" + first)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], body


def test_a_body_over_max_body_gets_413_before_it_is_read_whole(server):
    big = json.dumps({"model": MODEL, "prompt": "x" * 2_000_000, "max_tokens": 2}).encode()
    status, body = answer_before_the_body(server, len(big), big[:1024])
    assert b" 413 " in status and "1000000" in json.loads(body)["error"]["message"]
    status, _ = answer_before_the_body(server, 500_000_000, b"{")  # a length it never sends
    assert b" 413 " in status


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi"}, "max_tokens"),  # --kv-budget without max_tokens: a default within the budget, not a 500
    ({"prompt": "hi", "max_tokens": 4, "temperature": 1e-320}, "temperature"),
    ({"prompt": "hi", "max_tokens": 4, "top_k": 2**63}, "top_k"),
    ({"prompt": "hi", "max_tokens": 4, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format"),
    ({"prompt": "hi", "max_tokens": 4, "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "hi", "max_tokens": 4, "best_of": 2}, "best_of"),
    ({"prompt": "hi", "max_tokens": 4, "suffix": "!"}, "suffix"),
    ({"prompt": "hi", "max_tokens": 4, "temprature": 0.5}, "temprature"),
    ({"prompt": "hi", "max_tokens": 4, "stop": ["x" * 5000]}, "stop"),
    ({"prompt": "hi", "max_tokens": 4, "stop": [str(i) for i in range(100)]}, "stop"),
])
def test_hostile_fields_get_a_400_naming_the_field(server, body, param):
    status, _, answer = raw_status(server, "/v1/completions", json.dumps({"model": MODEL, **body}).encode())
    if param == "max_tokens":  # this one is served: the budget bounds what it may generate
        assert status == 200, answer
        return
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert "Tensor" not in answer["error"]["message"]


def test_a_lone_surrogate_gets_a_400_and_streams_get_400_before_the_200(server):
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "a\\ud800b", "max_tokens": 2}'
    status, _, answer = raw_status(server, "/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == "prompt"
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, "top_k": 2**63, "stream": True}).encode()
    assert raw_status(server, "/v1/completions", body)[0] == 400


def test_null_is_accepted_where_openai_accepts_it(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": None, "top_p": None, "n": None, "stream": None, "stop": None, "seed": None}
    status, _, answer = raw_status(server, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, answer


def test_usage_counts_exactly_the_tokens_returned_with_a_stop_string(server):
    client = server.client()
    common = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(max_tokens=24, **common)
    stop = full.choices[0].text[10:13]
    cut = client.completions.create(max_tokens=24, stop=[stop], **common)
    k = cut.usage.completion_tokens
    assert stop in client.completions.create(max_tokens=k, **common).choices[0].text  # k tokens reach the stop...
    assert stop not in client.completions.create(max_tokens=k - 1, **common).choices[0].text  # ...and no fewer


# ---- slow and silent clients -----------------------------------------------------------------------------


def closed_within(s: socket.socket, seconds: float, drip: bytes = b"") -> tuple[bool, bytes]:
    """Send `drip` a byte at a time (one every 0.2 s) until the server closes the connection or `seconds` pass;
    whether it closed, and what it answered."""
    s.settimeout(0.2)
    deadline, answer = time.monotonic() + seconds, b""
    for byte in [drip[i : i + 1] for i in range(len(drip))] or [b""] * int(seconds / 0.2 + 1):
        try:
            if byte:
                s.sendall(byte)
            chunk = s.recv(4096)
            if not chunk:
                return True, answer
            answer += chunk
        except socket.timeout:
            pass
        except OSError:  # reset: closed
            return True, answer
        if time.monotonic() > deadline:
            break
    return False, answer


def test_a_connection_that_sends_nothing_is_closed_after_the_read_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        closed, _ = closed_within(s, READ_TIMEOUT + 4)
    assert closed


def test_headers_sent_a_byte_at_a_time_are_cut_off(server):
    headers = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-Pad-%d: y\r\n" % i for i in range(40))
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        closed, _ = closed_within(s, READ_TIMEOUT + 4, drip=headers)
    assert closed


def test_a_body_that_trickles_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 200\r\n\r\n")
        closed, answer = closed_within(s, READ_TIMEOUT + 4, drip=b'{"prompt": "' + b"a" * 150)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert closed and b"body_timeout" in answer


def test_silent_connections_do_not_lock_out_health_on_a_small_open_file_limit(model_dir, tmp_path):  # noqa: F811
    def small_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    server = Server(model_dir, tmp_path / "server.log", "--read-timeout", "30", preexec_fn=small_limit)
    silent = []
    try:
        for _ in range(140):
            silent.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        with urllib.request.urlopen(server.url + "/health", timeout=5) as r:  # long before any timeout fires
            assert r.status == 200
    finally:
        for s in silent:
            s.close()
        server.stop()
    assert len((tmp_path / "server.log").read_text()) < 10_000


def test_an_upload_the_client_abandons_logs_no_traceback_and_counts_as_499(server):
    heads = [b"Content-Length: 1000\r\n\r\n{\"prompt\": \"ab", b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n"]
    for path in (b"/v1/completions", b"/v1/chat/completions"):
        for head in heads:
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                          b"\r\nContent-Type: application/json\r\n" + head)
                time.sleep(0.2)
    time.sleep(0.5)
    assert "Traceback" not in Path(server.log.name).read_text()
    assert 'quasar_requests_total{endpoint="/v1/completions",status="499"} 2' in server.exposition()


# ---- keys, errors, metrics ----------------------------------------------------------------------------------


def test_with_a_key_metrics_and_the_schema_need_it_and_health_stays_open(server):
    for path in ("/metrics", "/openapi.json"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.url + path, timeout=10)
        assert e.value.code == 401
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200


def test_the_key_comes_from_the_environment_or_a_file_not_only_argv(model_dir, tmp_path):  # noqa: F811
    key_file = tmp_path / "key"
    key_file.write_text("file-key\n")
    server = Server(model_dir, tmp_path / "server.log", "--api-key-file", str(key_file))
    try:
        assert "file-key" not in " ".join(server.proc.args)
        assert server.client("file-key").models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            server.client("wrong").models.list()
    finally:
        server.stop()
    os.environ["QUASAR_API_KEY"] = "env-key"
    try:
        server = Server(model_dir, tmp_path / "server2.log")
        try:
            assert server.client("env-key").models.list().data[0].id == MODEL
            with pytest.raises(openai.AuthenticationError):
                server.client("wrong").models.list()
        finally:
            server.stop()
    finally:
        del os.environ["QUASAR_API_KEY"]


def test_a_busy_server_says_when_to_retry(model_dir, tmp_path):  # noqa: F811
    server = Server(model_dir, tmp_path / "server.log", "--api-key", KEY, "--max-queue", "1", "--max-batch", "1")
    out: dict = {}
    try:
        long_stream(server, LONG_CONTEXT - 8, out)
        def wait() -> None:
            try:
                raw_status(server, "/v1/completions", json.dumps({"model": MODEL, "prompt": "b", "max_tokens": 2}).encode())
            except (OSError, http.client.HTTPException):  # the server is killed before it answers
                pass

        waiter = threading.Thread(target=wait)
        waiter.start()
        while server.metrics()["quasar_queue_length"] < 1:
            time.sleep(0.01)
        status, headers, _ = raw_status(server, "/v1/completions",
                                        json.dumps({"model": MODEL, "prompt": "c", "max_tokens": 2}).encode())
        assert status == 429 and int(headers["Retry-After"]) >= 1
    finally:
        server.proc.kill()
        server.proc.wait()
        server.log.close()


def test_a_non_streaming_client_that_hangs_up_frees_its_place(model_dir, tmp_path):  # noqa: F811
    server = Server(model_dir, tmp_path / "server.log", "--max-batch", "1")
    try:
        body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": LONG_CONTEXT - 8, "ignore_eos": True,
                           "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            while server.metrics()["quasar_requests_running"] < 1:
                time.sleep(0.01)
        # the client is gone: its generation stops long before LONG_CONTEXT tokens
        deadline = time.monotonic() + 30
        while server.metrics().get('quasar_generations_total{reason="cancelled"}', 0) < 1:
            assert time.monotonic() < deadline, "the hung-up request kept generating"
            time.sleep(0.05)
        assert server.metrics()["quasar_generation_tokens_total"] < (LONG_CONTEXT - 8) // 2
    finally:
        server.stop()


def test_a_taken_port_is_one_error_and_no_serving_line(model_dir, tmp_path):  # noqa: F811
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "quasar", "serve", "--model", str(model_dir), "--verifier", "fp32",
                               "--port", str(port)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "serving" not in done.stderr and f"could not serve on 127.0.0.1:{port}" in done.stderr
