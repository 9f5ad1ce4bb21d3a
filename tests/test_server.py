"""`quasar serve` as a real process on a loopback port, driven by the official openai client."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import tiny_hf_model, write_hf_dir

openai = pytest.importorskip("openai")

KEY = "test-key"
MODEL = "tiny"
LONG_CONTEXT = 4096  # room for a request long enough to still be running while the test acts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir: Path, log: Path, *extra: str, preexec_fn: Callable[[], None] | None = None) -> None:
        self.port, self.model_dir = free_port(), model_dir
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "quasar", "serve", "--model", str(model_dir), "--served-model-name", MODEL,
                "--verifier", "fp32", "--port", str(self.port), *extra]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}: {Path(self.log.name).read_text()}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("server did not become ready")

    def client(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, timeout=600)

    def exposition(self, key: str = KEY) -> str:
        request = urllib.request.Request(self.url + "/metrics", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", self.exposition(), re.MULTILINE)}

    def post(self, path: str, body: bytes, key: str = KEY) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=body, method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)  # stopped by its PID
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    hf = tiny_hf_model("llama", max_position_embeddings=LONG_CONTEXT)
    return write_hf_dir(hf, tmp_path_factory.mktemp("tiny-serve"), tokenizer_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("logs") / "server.log", "--api-key", KEY, "--max-queue", "32",
                 "--drafter", "ngram", "--k", "4")
    yield srv
    srv.stop()
    assert srv.proc.returncode is not None


@pytest.fixture(scope="module")
def expected(model_dir):
    """Greedy answers of plain decoding, computed in this process with the Python API: the server decodes
    speculatively (ngram drafter), which is lossless, so it must give the same."""
    from quasar import LLM, SamplingParams

    llm = LLM(model_dir, verifier="fp32")
    params = SamplingParams(max_new_tokens=12)

    def answer(prompt: str) -> str:
        return llm.generate([prompt], params)[0].text

    return answer


def test_models_and_completion(server, expected):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    resp = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    assert resp.choices[0].text == expected("The quick brown fox")
    assert resp.choices[0].finish_reason in ("length", "stop")
    usage = resp.usage
    assert usage.completion_tokens <= 12 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["speculative"]
    assert spec["verify_steps"] >= 1 and spec["mean_accepted_tokens"] >= 1.0
    assert 0.0 <= spec["acceptance_rate"] <= 1.0 and spec["accepted_tokens"] <= spec["proposed_tokens"]


def test_a_repeated_prompt_starts_from_the_kept_cache(server):
    """Prefix caching: a prompt sent again starts from the cache its first run left (all its tokens but the last,
    on quasar's kernels), says so in usage.prompt_tokens_details.cached_tokens and in /metrics, and answers the
    same."""
    from quasar.kernels import native

    client = server.client()
    prompt = "Rivers, mountains and seas: a prompt sent twice"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    before = server.metrics()["quasar_prompt_cached_tokens_total"]
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert again.choices[0].text == first.choices[0].text and first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (again.usage.prompt_tokens - 1 if native.kernel() is not None else 0)
    assert server.metrics()["quasar_prompt_cached_tokens_total"] == before + cached


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_equals_non_streaming_greedy(server, endpoint):
    client = server.client()
    common = {"model": MODEL, "max_tokens": 20, "temperature": 0}
    if endpoint == "chat":
        messages = [{"role": "user", "content": "Name three colours."}]
        full = client.chat.completions.create(messages=messages, **common)
        stream = client.chat.completions.create(messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **common)
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        text, reason = full.choices[0].message.content, full.choices[0].finish_reason
    else:
        full = client.completions.create(prompt="Once upon a time", **common)
        stream = client.completions.create(prompt="Once upon a time", stream=True,
                                           stream_options={"include_usage": True}, **common)
        chunks = list(stream)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        text, reason = full.choices[0].text, full.choices[0].finish_reason
    assert text and streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_without_a_kv_budget_the_caches_are_bounded_by_free_memory(server):
    budget = server.metrics()["quasar_kv_budget_positions"]
    assert budget >= 256 and budget % 256 == 0
    assert f"KV budget {int(budget):,} positions" in Path(server.log.name).read_text()


def test_sse_ends_with_done(server):
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_server_greedy_equals_quasar_generate(server, model_dir):
    prompt = "Write a haiku about the sea."
    out = subprocess.run(
        [sys.executable, "-m", "quasar", "generate", "--model", str(model_dir), "--verifier", "fp32",
         "--max-new-tokens", "16", "--json", prompt],
        capture_output=True, text=True, timeout=300, check=True,
    )
    cli = json.loads(out.stdout)
    resp = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0)
    assert resp.choices[0].message.content == cli["text"]
    assert resp.usage.completion_tokens == len(cli["token_ids"])


@pytest.mark.parametrize("body, param", [
    ({"model": "no-such-model", "prompt": "hi"}, "model"),
    ({"model": MODEL, "prompt": "hi", "temperature": 5}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "min_p": -0.1}, "min_p"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": LONG_CONTEXT}, "max_tokens"),  # beyond the context
    ({"model": MODEL, "prompt": "hi", "n": 17}, "n"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "temperature": "warm"}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "seed": 2**64}, "seed"),  # more than torch.Generator takes
    ({"model": MODEL, "prompt": "hi", "seed": -(2**63) - 1}, "seed"),
])
def test_bad_requests_get_400_with_an_openai_error(server, body, param):
    status, answer = server.post("/v1/completions", json.dumps(body).encode())
    assert status == 400
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
    assert answer["error"]["param"] == param


def test_bad_json_and_bad_messages_get_400(server):
    assert server.post("/v1/completions", b"{not json")[0] == 400
    assert server.post("/v1/chat/completions", b"[1, 2]")[0] == 400
    status, answer = server.post("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode())
    assert status == 400 and answer["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=2)


def test_missing_or_wrong_key_gets_401(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    assert server.post("/v1/completions", b"{}", key="")[0] == 401
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:  # health stays open for probes
        assert r.status == 200


def test_sixteen_concurrent_clients_all_answered(server, expected):
    prompts = [f"Request number {i} says" for i in range(16)]

    def ask(i: int) -> str:
        client = server.client()
        if i % 2:
            stream = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in stream if c.choices)
        return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert answers == [expected(p) for p in prompts]


def test_metrics_in_prometheus_format(server):
    assert server.post("/v1/completions", json.dumps({"model": MODEL}).encode())[0] == 400
    server.client().completions.create(model=MODEL, prompt="one two one two one two one two", max_tokens=8, temperature=0)
    metrics = server.metrics()
    assert metrics["quasar_generation_tokens_total"] >= 8
    assert metrics["quasar_mean_accepted_tokens"] >= 1.0
    assert metrics["quasar_proposed_tokens_total"] > 0  # the repetitive prompt gives the ngram drafter matches
    assert 0.0 <= metrics["quasar_acceptance_rate"] <= 1.0
    assert metrics["quasar_queue_length"] == 0
    assert metrics['quasar_request_latency_seconds_bucket{le="+Inf"}'] == metrics["quasar_request_latency_seconds_count"]
    assert metrics['quasar_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert metrics['quasar_requests_total{endpoint="/v1/completions",status="400"}'] >= 1


def test_a_crafted_path_neither_adds_a_label_nor_injects_a_line(server):
    """uvicorn percent-decodes the path: quotes and a newline reach the app."""
    for path in ("/v1/x%22%7D%201%0Afake_metric%202", "/v1/other-1", "/v1/other-2"):
        assert server.post(path, b"{}")[0] == 404
    lines = server.exposition().splitlines()
    assert not [line for line in lines if line.startswith("fake_metric") or "/v1/x" in line or "/v1/other-" in line]
    assert server.metrics()['quasar_requests_total{endpoint="other",status="404"}'] >= 3


def test_full_queue_429_and_disconnect_frees_the_worker(model_dir, tmp_path):
    """One request generates (--max-batch 1), one waits (--max-queue 1): a third gets 429. The streaming client then goes away:
    its generation stops early (far fewer tokens than asked) and the waiting request is answered."""
    server = Server(model_dir, tmp_path / "server.log", "--max-queue", "1", "--max-batch", "1")
    try:
        client = server.client()
        long_run = client.completions.create(model=MODEL, prompt="a", max_tokens=LONG_CONTEXT - 8, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        next(iter(long_run))  # it is generating now
        waiting: dict[str, str] = {}
        waiter = threading.Thread(target=lambda: waiting.update(text=client.completions.create(
            model=MODEL, prompt="b", max_tokens=4, temperature=0).choices[0].text))
        waiter.start()
        while server.metrics()["quasar_queue_length"] < 1:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="c", max_tokens=4, temperature=0)
        long_run.close()  # the client disconnects mid-stream
        waiter.join(timeout=120)
        assert "text" in waiting
        after = client.completions.create(model=MODEL, prompt="d", max_tokens=4, temperature=0)
        assert after.usage.completion_tokens == 4
        metrics = server.metrics()
        assert metrics['quasar_generations_total{reason="cancelled"}'] == 1
        assert metrics["quasar_generation_tokens_total"] < (LONG_CONTEXT - 8) // 2
        assert metrics['quasar_requests_total{endpoint="/v1/completions",status="429"}'] == 1
    finally:
        server.stop()


def test_vllm_dry_run_prints_the_equivalent_command(model_dir):
    import shlex

    out = subprocess.run(
        [sys.executable, "-m", "quasar", "serve", "--engine", "vllm", "--dry-run", "--model", str(model_dir),
         "--verifier", "bf16", "--drafter", "ngram", "--k", "4", "--ngram-max", "2", "--port", "9001",
         "--served-model-name", MODEL, "--api-key", KEY],
        capture_output=True, text=True, timeout=300, check=True,
    )
    argv = shlex.split(out.stdout.strip())
    assert argv[:3] == ["vllm", "serve", str(model_dir)]
    options = dict(zip(argv[3::2], argv[4::2]))
    assert options["--dtype"] == "bfloat16" and options["--port"] == "9001" and options["--host"] == "127.0.0.1"
    assert options["--served-model-name"] == MODEL and options["--api-key"] == KEY
    assert json.loads(options["--speculative-config"]) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def test_vllm_hand_off_refuses_drafters_vllm_cannot_run(model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "quasar", "serve", "--engine", "vllm", "--dry-run", "--model", str(model_dir),
         "--verifier", "fp32", "--drafter", "suffix"], capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 1 and "supports --drafter none or ngram" in out.stderr


def test_sixty_four_clients_with_disconnects_get_their_own_answers(model_dir, tmp_path):
    """bf16 on quasar's kernels, so requests really share forwards (16 at a time, few rows per forward: drafts
    cut, prompts chunked). 64 concurrent clients, greedy and seeded sampled, a quarter of them streaming and
    hanging up early: every other answer is exactly its answer alone (nothing lost, repeated or crossed), the
    server frees every slot, and it answers correctly afterwards."""
    from quasar import LLM, SamplingParams
    from quasar.kernels.native import kernel

    if kernel() is None:
        pytest.skip("quasar's CPU kernels are not available here")
    server = Server(model_dir, tmp_path / "server.log", "--verifier", "bf16", "--drafter", "ngram",
                    "--max-batch", "16", "--max-batch-tokens", "24", "--max-queue", "64")
    try:
        prompts = [f"Client {i} writes: " + "one two three " * (i % 7) + f"and then {i}" for i in range(64)]
        params = [SamplingParams(max_new_tokens=8 + i % 17, ignore_eos=True, temperature=0.0 if i % 3 else 0.9,
                                 seed=None if i % 3 else i) for i in range(64)]
        wanted = LLM(model_dir, verifier="bf16", drafter="ngram").generate(prompts, params)

        def ask(i: int) -> tuple[str, int] | None:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
            p = params[i]
            args = dict(model=MODEL, prompt=prompts[i], max_tokens=p.max_new_tokens, temperature=p.temperature,
                        seed=p.seed, extra_body={"ignore_eos": True})
            if i % 4 == 3:  # hangs up after two pieces
                stream = client.completions.create(**args, stream=True)
                for n, _ in enumerate(stream):
                    if n == 1:
                        break
                stream.close()
                return None
            if i % 4 == 1:
                stream = client.completions.create(**args, stream=True, stream_options={"include_usage": True})
                pieces, tokens = [], 0
                for chunk in stream:
                    pieces += [c.text for c in chunk.choices]
                    tokens = chunk.usage.completion_tokens if chunk.usage else tokens
                return "".join(pieces), tokens
            reply = client.completions.create(**args)
            return reply.choices[0].text, reply.usage.completion_tokens

        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(ask, range(64)))
        for i, answer in enumerate(answers):
            if answer is not None:
                assert answer == (wanted[i].text, len(wanted[i].token_ids)), i
        deadline = time.monotonic() + 30
        while (server.metrics()["quasar_requests_running"] or server.metrics()["quasar_queue_length"]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        metrics = server.metrics()
        assert metrics["quasar_requests_running"] == 0 and metrics["quasar_queue_length"] == 0
        assert metrics['quasar_requests_total{endpoint="/v1/completions",status="200"}'] == 64
        again = server.client().completions.create(model=MODEL, prompt=prompts[1], max_tokens=params[1].max_new_tokens,
                                                   temperature=0, extra_body={"ignore_eos": True})  # greedy
        assert again.choices[0].text == wanted[1].text
    finally:
        server.stop()


def test_the_openai_client_stop_seed_and_n(server):
    """What the official client sends for stop strings, a seed and n: stop ends the text before the string with
    finish_reason 'stop'; the same seed samples the same text; n > 16 is refused with a 400 naming n."""
    client = server.client()
    full = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=16, temperature=0)
    stop = full.choices[0].text[4:7]
    cut = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert full.choices[0].text.startswith(cut.choices[0].text)
    messages = [{"role": "user", "content": "Say something surprising."}]
    sampled = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0.9, seed=7)
               for _ in range(2)]
    assert sampled[0].choices[0].message.content == sampled[1].choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="n"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=17)


def test_the_openai_client_logprobs_n_and_a_penalty(server):
    """logprobs, n = 2 and a penalty through the official client, streamed and not: the speculative server's
    greedy choices are plain decoding's under the penalty, with the same logprobs in both shapes."""
    from quasar import LLM, SamplingParams

    client = server.client()
    messages = [{"role": "user", "content": "Repeat: one two one two one two"}]
    common = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0, "frequency_penalty": 1.0}
    reply = client.chat.completions.create(n=2, logprobs=True, top_logprobs=3, **common)
    assert [c.index for c in reply.choices] == [0, 1] and reply.choices[0].message == reply.choices[1].message
    content = reply.choices[0].logprobs.content
    assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)
    assert reply.usage.completion_tokens == 2 * len(content)
    params = SamplingParams(max_new_tokens=10, frequency_penalty=1.0, logprobs=3)
    plain = LLM(server.model_dir, verifier="fp32").chat(messages, params)
    assert reply.choices[0].message.content == plain.text
    assert [e.logprob for e in content] == pytest.approx([lp.logprob for lp in plain.logprobs], abs=1e-4)
    stream = client.chat.completions.create(stream=True, logprobs=True, top_logprobs=3, **common)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == plain.text
    assert [e.token for c in chunks if c.logprobs for e in c.logprobs.content] == [e.token for e in content]


def test_the_openai_client_parses_a_pydantic_model_and_calls_tools_streamed_or_not(server):
    """`chat.completions.parse(response_format=Model)` gets an object that validates against Model; a required tool
    call comes back as tool_calls, the same streamed (the client's own accumulation) as whole."""
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]
        sure: bool

    client = server.client()
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    reply = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Verdict, max_tokens=32,
                                          temperature=0)
    assert isinstance(reply.choices[0].message.parsed, Verdict)
    tools = [{"type": "function", "function": {"name": "look", "parameters": {
        "type": "object", "properties": {"where": {"enum": ["up", "down"]}}, "required": ["where"],
        "additionalProperties": False}}}]
    one = {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 32, "temperature": 0}
    whole = client.chat.completions.create(model=MODEL, messages=messages, **one)
    assert whole.choices[0].finish_reason == "tool_calls"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]
    assert len(calls) == 1 and calls[0][0] == "look" and calls[0][1]["where"] in ("up", "down")
    with client.chat.completions.stream(model=MODEL, messages=messages, **one) as stream:
        streamed = stream.get_final_completion()
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.choices[0].message.tool_calls] == calls
