"""Tool calls read out of an answer (quasar.serve.tools): piece by piece as whole, for each form a model writes."""

from __future__ import annotations

import json

import pytest

from quasar.decoding.grammar import Constraint
from quasar.serve.tools import ToolPlan, ToolReply

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ADD = {"type": "function", "function": {"name": "add"}}


def read(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[dict]]:
    reply = ToolReply(plan)
    deltas = [d for piece in pieces for d in reply.feed(piece)] + reply.finish()
    assert "".join(d.text for d in deltas if d.index is None) == reply.content  # the deltas add up to the reply
    for i, call in enumerate(reply.calls):
        assert "".join(d.text for d in deltas if d.index == i and d.name is None) == call["function"]["arguments"]
    return reply.content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.calls]


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_required_calls_read_the_same_in_any_pieces(size):
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo \\"}{["}}, {"name": "add", "arguments": {}}]'
    content, calls = read(ToolPlan("required", (WEATHER, ADD)), pieces_of(text, size))
    assert content == "" and calls == [("get_weather", {"city": 'Oslo "}{['}), ("add", {})]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_tagged_calls_and_the_text_around_them(size):
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool'
    content, calls = read(ToolPlan("auto", (WEATHER,)), pieces_of(text, size))
    assert calls == [("get_weather", {"city": "Paris"})]
    assert content == "Let me check.\n\n<tool"  # a tag's start that never completes is text after all


def test_a_tagged_call_that_does_not_parse_stays_text():
    text = "<tool_call>\n{not json}\n</tool_call>"
    assert read(ToolPlan("auto", (WEATHER,)), [text]) == (text, [])


def test_a_named_choice_reads_the_whole_answer_as_its_arguments():
    assert read(ToolPlan("named", (WEATHER,), "get_weather"), ['{"city": ', '"Rome"}']) == (
        "",
        [("get_weather", {"city": "Rome"})],
    )


def test_the_schemas_hold_names_arguments_and_the_number_of_calls():
    plan = ToolPlan("required", (WEATHER, ADD), parallel=False)
    schema = plan.schema()
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    Constraint("json_schema", schema)  # llguidance compiles it
    no_arguments = {"type": "object", "properties": {}, "additionalProperties": False}
    assert ToolPlan("named", (WEATHER, ADD), "add").schema() == no_arguments
    assert ToolPlan("auto", (WEATHER,)).schema() is None


@pytest.mark.parametrize(
    "text, calls",
    [
        (
            '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```',
            [("get_weather", {"city": "Paris"})],
        ),
        ('[{"name": "add", "arguments": {}}, {"name": "add", "arguments": {}}]', [("add", {}), ("add", {})]),
        ('{{"name": "get_weather", "arguments": {"city": "Oslo"}}}', [("get_weather", {"city": "Oslo"})]),
        ('{"name": "unknown", "arguments": {}}', []),
        ('{"a": 1} is JSON', []),
    ],
)
def test_a_bare_call_as_the_whole_answer_is_read_as_calls_in_any_pieces(text, calls):
    for size in (1, 5, 1000):
        content, got = read(ToolPlan("auto", (WEATHER, ADD)), pieces_of(text, size))
        assert got == calls and content == ("" if calls else text)


def test_without_parallel_calls_the_first_tagged_call_alone_counts():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    text = call % "Oslo" + "\n" + call % "Rome"
    assert read(ToolPlan("auto", (WEATHER,), parallel=False), [text]) == ("\n", [("get_weather", {"city": "Oslo"})])
    assert read(ToolPlan("auto", (WEATHER,)), [text])[1] == [("get_weather", {"city": c}) for c in ("Oslo", "Rome")]


def test_arguments_that_are_no_json_leave_the_call_as_text():
    text = '<tool_call>{"name": "get_weather", "arguments": "city=Oslo"}</tool_call>'
    assert read(ToolPlan("auto", (WEATHER,)), [text]) == (text, [])
