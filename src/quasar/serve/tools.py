"""Tool calls: the request's `tools` and `tool_choice` as a prompt and a structure, and the answer as `tool_calls`.

- `none` (or no tools): the tools are not shown to the model; the answer is text.
- `auto`: the tools go through the model's own chat template (Qwen2.5's lists them in its system turn); the model
  writes text or calls, each as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen's and Hermes'
  form), parsed out of the text. A template that takes no tools cannot ask the model, so `auto` is refused there.
- `required`: the answer is held (quasar.decoding.grammar) to a JSON array of calls, `[{"name": N, "arguments":
  {...}}, ...]`, each name one of the tools' and its arguments valid under that tool's `parameters` (one call only
  when `parallel_tool_calls` is false); the tools also go through the template when it takes them.
- a named function: the answer is held to that function's `parameters`: it is the call's arguments.

`ToolReply` turns the answer's text, whole or piece by piece, into content and calls, as deltas in the order
OpenAI streams them: a call's id and name first, then its arguments as they arrive; the whole answer is the sum of
its deltas, so a streamed reply and a whole one say the same.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # a tool without parameters


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask: `mode` (auto, required or named), the tools as the template takes them, the
    function a named choice forces, and whether several calls may come at once."""

    mode: str
    tools: tuple[dict[str, Any], ...]
    name: str | None = None
    parallel: bool = True

    def parameters(self, name: str) -> dict[str, Any]:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or NO_ARGUMENTS

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer is held to (None for auto: the model chooses)."""
        if self.mode == "named":
            return self.parameters(self.name or "")
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": self.parameters(t["function"]["name"]),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        return array | ({} if self.parallel else {"maxItems": 1})


class Delta(NamedTuple):
    """A piece of a reply: text content (`index` None), or call `index`'s id and name (when it starts) or a piece
    of its arguments."""

    index: int | None
    text: str = ""
    id: str | None = None
    name: str | None = None


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolReply:
    """An answer's text -> content and tool calls, fed piece by piece (`feed`) and ended (`finish`)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.content = ""
        self.calls: list[dict[str, Any]] = []  # OpenAI tool_calls, their arguments growing
        self.scan = {"auto": TaggedCalls, "required": CallArray, "named": NamedCall}[plan.mode](plan)

    def feed(self, piece: str) -> list[Delta]:
        return self.record(self.scan.feed(piece))

    def finish(self) -> list[Delta]:
        return self.record(self.scan.finish())

    def record(self, deltas: list[Delta]) -> list[Delta]:
        for delta in deltas:
            if delta.index is None:
                self.content += delta.text
            elif delta.name is not None:
                self.calls.append(
                    {"id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": ""}}
                )
            else:
                self.calls[delta.index]["function"]["arguments"] += delta.text
        return deltas


class NamedCall:
    """The whole answer is the arguments of the one function a named choice forces."""

    def __init__(self, plan: ToolPlan) -> None:
        self.name, self.started = plan.name, False

    def feed(self, piece: str) -> list[Delta]:
        out = [] if self.started else [Delta(0, id=call_id(), name=self.name)]
        self.started = True
        return out + ([Delta(0, piece)] if piece else [])

    def finish(self) -> list[Delta]:
        return self.feed("")


class CallArray:
    """`[{"name": "N", "arguments": {...}}, ...]` in the layout the grammar forces (quasar.decoding.grammar's
    JSON_LAYOUT): a call starts at its name; its arguments run to the brace that closes them."""

    HEAD = re.compile(r'\}?\s*[\[,]\s*\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')

    def __init__(self, plan: ToolPlan) -> None:
        self.text, self.pos, self.calls = "", 0, 0
        self.in_arguments = self.in_string = self.escaped = False
        self.depth = 0

    def feed(self, piece: str) -> list[Delta]:
        self.text += piece
        out: list[Delta] = []
        while True:
            if not self.in_arguments:
                head = self.HEAD.match(self.text, self.pos)
                if head is None:
                    return out
                out.append(Delta(self.calls, id=call_id(), name=json.loads(f'"{head[1]}"')))
                self.pos, self.in_arguments, self.depth = head.end(), True, 0
                self.calls += 1
                continue
            start = self.pos
            closed = self.advance()
            if self.pos > start:
                out.append(Delta(self.calls - 1, self.text[start : self.pos]))
            if not closed:
                return out
            self.in_arguments = False

    def advance(self) -> bool:
        """Move `pos` over the arguments' characters that have arrived; True once they are whole."""
        for i in range(self.pos, len(self.text)):
            c = self.text[i]
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (c == "\\", c != '"')
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                if self.depth == 0:  # the call's own brace: the arguments (a bare value) ended before it
                    self.pos = i
                    return True
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return True
        self.pos = len(self.text)
        return False

    def finish(self) -> list[Delta]:
        return []


class TaggedCalls:
    """Text with calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen2.5, Hermes): the text
    outside them is content (held back while it could be the start of a tag); a call is read whole at its closing
    tag, and one that does not parse stays content. A small model may write its call bare instead, as the whole
    answer: a JSON object (or a list of them) with a tool's name and arguments, maybe in a ```json fence. An answer
    that starts like that is held back to its end and read as calls when it is one."""

    def __init__(self, plan: ToolPlan) -> None:
        self.pending, self.inside, self.calls = "", False, 0
        self.names = {tool["function"]["name"] for tool in plan.tools}
        self.bare: bool | None = None  # whether the answer starts as a bare call might (None: nothing written yet)
        self.single = not plan.parallel  # parallel_tool_calls false: the first call alone

    def feed(self, piece: str) -> list[Delta]:
        self.pending += piece
        head = self.pending.lstrip()
        if self.bare is None and head and (len(head) >= 3 or not "```".startswith(head)):
            self.bare = head.startswith(("{", "[", "```"))
        if self.bare is not False:  # held back to the end (or until something is written)
            return []
        out: list[Delta] = []
        while True:
            tag = CLOSE if self.inside else OPEN
            at = self.pending.find(tag)
            if at < 0:
                if not self.inside:
                    keep = partial_tag(self.pending, OPEN)
                    text, self.pending = (
                        self.pending[: len(self.pending) - keep],
                        self.pending[len(self.pending) - keep :],
                    )
                    out += [Delta(None, text)] if text else []
                return out
            if self.inside:
                out += self.call(self.pending[:at])
            elif self.pending[:at]:
                out.append(Delta(None, self.pending[:at]))
            self.pending, self.inside = self.pending[at + len(tag) :], not self.inside

    def call(self, body: str) -> list[Delta]:
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (json.JSONDecodeError, KeyError, TypeError):
            return [Delta(None, OPEN + body + CLOSE)]
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            if not is_json(arguments):  # no call a client could send back: text
                return [Delta(None, OPEN + body + CLOSE)]
            arguments = json.loads(arguments)
        if self.single and self.calls:
            return []
        text = json.dumps(arguments, ensure_ascii=False)
        self.calls += 1
        return [Delta(self.calls - 1, id=call_id(), name=name), Delta(self.calls - 1, text)]

    def finish(self) -> list[Delta]:
        if self.bare:
            calls = self.bare_calls(self.pending)
            if calls:
                self.pending = ""
                return [
                    d
                    for name, arguments in calls
                    for d in self.call(json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False))
                ]
            self.bare = False
            return self.feed("") + self.finish()
        rest = (OPEN if self.inside else "") + self.pending
        self.pending = ""
        return [Delta(None, rest)] if rest else []

    def bare_calls(self, text: str) -> list[tuple[str, Any]]:
        """The whole answer as (name, arguments) calls of the request's tools, or [] when it is not that."""
        text = re.sub(r"^```(?:json)?\s*|\s*```$", "", text.strip())
        doubled = text.startswith("{{")  # Qwen2.5's template shows the call as {{"name": ...}}: a model may copy it
        for candidate in (text, text[1:] if doubled else None, text[1:-1] if doubled else None):
            try:
                value = json.loads(candidate) if candidate else None
            except json.JSONDecodeError:
                continue
            calls = value if isinstance(value, list) else [value]
            if calls and all(isinstance(c, dict) and c.get("name") in self.names and "arguments" in c for c in calls):
                return [(c["name"], c["arguments"]) for c in calls]
        return []


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag`."""
    return next((n for n in range(min(len(text), len(tag) - 1), 0, -1) if text.endswith(tag[:n])), 0)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
