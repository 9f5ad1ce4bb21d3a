"""The server's per-request sampling fields (logprobs, n, penalties, logit_bias, min_tokens, stop_token_ids), in
this process over ASGI: strict validation naming the field, and OpenAI-shaped choices and logprobs, streamed and
not, the same either way."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import decoder_for
from test_server_app import run

from quasar.decoding.engine import Engine
from quasar.serve.app import create_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Count: 1, 2, 3"}], "max_tokens": 6}
COMPLETION = {"model": "tiny", "prompt": "Count: 1, 2, 3", "max_tokens": 6}


@pytest.fixture(scope="module")
def app(tiny_model):
    app = create_app(Engine(tiny_model, decoder_for("ngram", tiny_model, k=4)), "tiny")
    yield app
    app.state.scheduler.stop()


def post(app: Any, path: str, *bodies: dict[str, Any]) -> list[tuple[int, str]]:
    return run(*(("POST", path, body) for body in bodies), app=app)


def events(body: str) -> list[dict[str, Any]]:
    lines = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


BAD = [
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"1": 500}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),  # beyond the vocabulary
    ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": "1"}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"min_tokens": 7}, "min_tokens"),  # more than max_tokens
    ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [99999999]}, "stop_token_ids"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 17}, "n"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
    ("/v1/completions", {"stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
]


def test_bad_values_get_a_400_naming_the_field(app):
    answers = [post(app, path, (CHAT if "chat" in path else COMPLETION) | body)[0] for path, body, _ in BAD]
    for (path, body, param), (status, answer) in zip(BAD, answers):
        assert status == 400, (body, answer)
        assert json.loads(answer)["error"]["param"] == param, (body, answer)


def test_chat_logprobs_and_n_streamed_and_not(app, tiny_model):
    body = CHAT | {"temperature": 0, "n": 2, "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.5}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    [(status, answer), (streamed, chunks)] = post(app, "/v1/chat/completions", body, body | stream)
    assert status == 200 and streamed == 200
    reply = json.loads(answer)
    choices = reply["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["message"] == choices[1]["message"]  # greedy: both choices alike
    content = choices[0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"] // 2
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the most likely token
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"]) and entry["logprob"] <= 0
    text = bytes(b for entry in content for b in entry["bytes"]).decode("utf-8", errors="replace")
    assert text.startswith(choices[0]["message"]["content"])  # the text, and EOS's bytes if it ended so
    texts, logprobs, reasons = ["", ""], [[], []], [[], []]
    for chunk in events(chunks)[:-1]:
        for c in chunk["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
            logprobs[c["index"]] += c["logprobs"]["content"] if c["logprobs"] else []
            reasons[c["index"]] += [c["finish_reason"]] if c["finish_reason"] else []
    assert texts == [c["message"]["content"] for c in choices]
    assert logprobs == [c["logprobs"]["content"] for c in choices]
    assert reasons == [[c["finish_reason"]] for c in choices]  # one finish chunk per choice
    usage = events(chunks)[-1]["usage"]  # the last chunk: the usage of both choices
    assert usage["completion_tokens"] == reply["usage"]["completion_tokens"]


def test_completion_logprobs_streamed_and_not(app):
    body = COMPLETION | {"temperature": 0, "logprobs": 2, "n": 2, "seed": 3}
    [(status, answer), (_, chunks)] = post(app, "/v1/completions", body, body | {"stream": True})
    assert status == 200
    choice = json.loads(answer)["choices"][0]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0 and "".join(logprobs["tokens"]).startswith(choice["text"])
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in events(chunks):
        for c in chunk["choices"]:
            if c["index"] == 0 and c["logprobs"]:
                for key in streamed:
                    streamed[key] += c["logprobs"][key]
    assert streamed == {key: logprobs[key] for key in streamed}


def test_sampled_choices_differ_and_a_seed_repeats_them(app):
    body = CHAT | {"temperature": 1.0, "n": 3, "seed": 11, "max_tokens": 4, "ignore_eos": True}
    [(_, first), (_, second)] = post(app, "/v1/chat/completions", body, body)
    texts = [[c["message"]["content"] for c in json.loads(a)["choices"]] for a in (first, second)]
    assert texts[0] == texts[1] and len(set(texts[0])) == 3
    assert json.loads(first)["usage"]["completion_tokens"] == 3 * 4  # every choice counted
