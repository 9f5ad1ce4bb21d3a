"""Structured output and tool calls through the server app (in this process, over ASGI): response_format and
vLLM's guided_* hold the answer, tools come back as tool_calls streamed or whole, and bad input is a 400 naming the
field before anything runs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from test_server_app import run

from quasar.decoding.engine import Engine
from quasar.serve.app import create_app

BOUNDED = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe later"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["C", "F"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Is it raining?"}],
    "max_tokens": 40,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def app(tiny_model):
    from helpers import decoder_for

    app = create_app(Engine(tiny_model, decoder_for("ngram", tiny_model, k=4)), "tiny")
    yield app
    app.state.scheduler.stop()


def post(app, *bodies: dict) -> list[tuple[int, dict | list[dict]]]:
    """Each body to /v1/chat/completions: (status, the JSON answer, or a stream's chunks)."""
    out = []
    for status, text in run(*(("POST", "/v1/chat/completions", CHAT | body) for body in bodies), app=app):
        if text.startswith("data: "):
            events = [e.removeprefix("data: ") for e in text.strip().split("\n\n")]
            assert events[-1] == "[DONE]"
            out.append((status, [json.loads(e) for e in events[:-1]]))
        else:
            out.append((status, json.loads(text)))
    return out


def test_response_format_and_guided_fields_hold_the_answer(app):
    schema = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": BOUNDED, "strict": True}}
    answers = post(
        app,
        {"response_format": schema},
        {"guided_json": BOUNDED},
        {"guided_regex": "(yes|no)!"},
        {"guided_choice": ["red", "green"]},
        {"response_format": {"type": "json_object"}, "max_tokens": 8},
    )
    assert all(status == 200 for status, _ in answers), answers
    texts = [a["choices"][0]["message"]["content"] for _, a in answers]
    jsonschema.validate(json.loads(texts[0]), BOUNDED)
    assert texts[1] == texts[0]  # the same schema by either name
    assert re.fullmatch("(yes|no)!", texts[2]) and texts[3] in ("red", "green")
    assert texts[4].startswith("{")
    speculative = answers[0][1]["usage"]["speculative"]
    assert speculative["forced_tokens"] > 0  # the schema's keys and quotes were drafted for free


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_regex": "(ab"}, "guided_regex"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
        ({"guided_json": BOUNDED, "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": BOUNDED, "ignore_eos": True}, "ignore_eos"),
        ({"guided_json": BOUNDED, "stop": ["}"]}, "stop"),  # a stop would cut the structure short of valid
        ({"response_format": {"type": "json_object"}, "stop_token_ids": [3]}, "stop_token_ids"),
        ({"logit_bias": {"\u00b2": 1.0}}, "logit_bias"),  # a digit to str.isdigit, not to int()
        ({"n": 1000}, "n"),  # more choices than the queue holds
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),  # this model's template takes no tools
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools.1.function.name"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_structures_and_tools_get_a_400_naming_the_field(app, body, param):
    [(status, answer)] = post(app, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


def test_a_required_tool_call_comes_back_as_tool_calls_streamed_or_whole(app):
    body = {
        "tools": [WEATHER, {"type": "function", "function": {"name": "now"}}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    (status, whole), (_, chunks) = post(app, body, body | {"stream": True})
    assert status == 200, whole
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    for call in calls:
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    streamed: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk["choices"][0]["delta"].get("tool_calls") or ():
            call = streamed.setdefault(delta["index"], {"name": None, "arguments": ""})
            call["name"] = delta["function"].get("name") or call["name"]
            call["arguments"] += delta["function"]["arguments"]
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}  # as OpenAI's: no content


def test_a_streamed_reply_without_tool_calls_opens_with_empty_content(app):
    [(status, chunks)] = post(app, {"stream": True, "max_tokens": 4})
    assert status == 200
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])


def test_a_named_tool_and_a_round_trip_with_the_tool_result(app):
    named = {
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
    }
    [(status, answer)] = post(app, named)
    assert status == 200, answer
    [call] = answer["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["unit"] in ("C", "F")
    history = [
        *CHAT["messages"],
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"rain": true}'},
    ]
    # the tool's answer goes back through the template; "auto" (the default with tools) needs a template with tools
    [(status, final)] = post(app, {"messages": history, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 4})
    assert status == 200, final
    assert final["choices"][0]["message"]["content"] is not None


def test_each_of_n_choices_is_read_as_its_own_tool_calls(app):
    body = {
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "n": 2,
        "temperature": 1.0,
        "seed": 3,
    }
    (status, whole), (_, chunks) = post(app, body, body | {"stream": True})
    assert status == 200, whole
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    for choice in whole["choices"]:
        [call] = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and json.loads(call["function"]["arguments"])["unit"] in "CF"
    streamed = {i: "" for i in (0, 1)}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for delta in choice["delta"].get("tool_calls") or ():
                streamed[choice["index"]] += delta["function"]["arguments"]
    assert [streamed[i] for i in (0, 1)] == [
        c["message"]["tool_calls"][0]["function"]["arguments"] for c in whole["choices"]
    ]
