"""A chat request's messages and tool definitions as OpenAI sends them (the fields of ChatRequest,
serve/protocol.py), and how a message goes to a chat template."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from quasar.serve.errors import BadRequest


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None  # None: an assistant turn that only called tools
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> dict[str, Any]:
        """The message as a chat template takes it: text content; a call's arguments as an object (Qwen's template
        writes them with `tojson`)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content_text()}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": arguments(call.function.arguments)}}
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def content_text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise BadRequest("only text content parts are supported", param="messages")
        return "".join(str(part.get("text", "")) for part in self.content)


def arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise BadRequest(f"a tool call's arguments are not JSON: {text[:80]!r}", param="messages") from None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionName
