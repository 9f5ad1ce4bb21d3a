"""OpenAI request bodies -> (prompt ids, SamplingParams) (the chat's messages and tools: serve/messages.py; the
responses: serve/responses.py).

Validation lives here so that every bad input becomes a 400 with an OpenAI error object (serve/errors.py)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from quasar.decoding.engine import Engine, KVBudgetError, PromptTooLongError
from quasar.decoding.grammar import Constraint, GrammarError
from quasar.decoding.sampling import MAX_BIAS, MAX_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams
from quasar.serve.errors import BadRequest
from quasar.serve.messages import Message, NamedToolChoice, ToolDef
from quasar.serve.tools import ToolPlan


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


MIN_TEMPERATURE = 1e-5  # below this (but 0, greedy) the sampling weights overflow: refused, not rounded
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings a request may give, and characters each (matching cost)
TOP_K_MAX = 2**31 - 1
# Fields the OpenAI API defines that this server does not implement: a request that sets one is refused with a
# 400 naming it, rather than answered as if it had not asked (None, and the value meaning "off", are accepted).
NOT_IMPLEMENTED = {
    "functions": [], "function_call": "none", "best_of": 1, "suffix": "", "echo": False, "prediction": None,
    "audio": None, "modalities": ["text"], "reasoning_effort": None, "web_search_options": None,
}
MAX_CHOICES = 16  # `n`: the choices of one request run as that many requests in the batch
IGNORED = ("user", "metadata", "store", "service_tier")  # bookkeeping fields with no effect on the output


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: the schema the answer follows. `strict` is accepted either way: the answer
    always follows the schema (quasar.decoding.grammar)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions; any other field is refused (parse). Types are
    strict, as the OpenAI API's: "10" is no max_tokens and "yes" no stream (a 400 names the field)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=TOP_K_MAX)  # extension (vLLM): -1 or 0 keeps all
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # extension (vLLM)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # what SamplingParams (torch) accepts
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    ignore_eos: bool = False  # extension (vLLM)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)  # extension (vLLM)
    logit_bias: dict[str, float] | None = None  # {token id as a string: bias in [-100, 100]}
    min_tokens: int = Field(0, ge=0)  # extension (vLLM)
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # extensions (vLLM): structured output
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true (as OpenAI's API)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.isascii() and token.isdigit()):
                raise ValueError(f"keys must be token ids written as strings of digits, got {token!r}")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ValueError(f"biases must lie in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if any(token < 0 for token in value or ()):
            raise ValueError("token ids are >= 0")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return value

    def sampling(self, max_new_tokens: int, vocab_size: int, tools: ToolPlan | None = None) -> SamplingParams:
        """The SamplingParams asked for, with at most `max_new_tokens` (BadRequest naming the field for a value the
        model's vocabulary or the token budget refuses); `tools`: the tool plan, whose schema (if any) holds the
        answer."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        bias = {int(token): value for token, value in (self.logit_bias or {}).items()}
        for name, tokens in (("logit_bias", bias), ("stop_token_ids", self.stop_token_ids or ())):
            if any(token >= vocab_size for token in tokens):
                raise BadRequest(f"{name!r} names a token id beyond the vocabulary ({vocab_size} tokens)", param=name)
        if self.min_tokens > max_new_tokens:
            raise BadRequest(f"min_tokens ({self.min_tokens}) is more than the request may generate "
                             f"({max_new_tokens})", param="min_tokens")
        param, structure = self.structure(tools)
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), min_p=self.min_p,
                seed=self.seed, max_new_tokens=max_new_tokens, stop=stop, ignore_eos=self.ignore_eos,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, logit_bias=tuple(bias.items()), min_tokens=self.min_tokens,
                stop_token_ids=tuple(self.stop_token_ids or ()), logprobs=self.top_logprob_count, **structure,
            )
        except GrammarError as e:
            raise BadRequest(f"invalid {param!r}: {e.reason}", param=param) from None

    @property
    def top_logprob_count(self) -> int | None:
        """How many of the most likely tokens to report at each position; None: no logprobs."""
        return None

    def structure(self, tools: ToolPlan | None = None) -> tuple[str | None, dict[str, Any]]:
        """The structured-output fields (and the tools' schema) as SamplingParams takes them, and the request field
        they came from; BadRequest when more than one asks for a structure."""
        asked: list[tuple[str, dict[str, Any]]] = []
        if tools is not None and tools.schema() is not None:
            asked.append(("tool_choice", {"json_schema": tools.schema()}))
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise BadRequest("response_format of type 'json_schema' needs a 'json_schema' object",
                                 param="response_format.json_schema")
            asked.append(("response_format", {"json_schema": fmt.json_schema.json_schema}))
        if self.guided_json is not None:
            asked.append(("guided_json", {"json_schema": self.guided_json}))
        if self.guided_regex is not None:
            asked.append(("guided_regex", {"regex": self.guided_regex}))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", {"grammar": self.guided_grammar}))
        if self.guided_choice is not None:
            asked.append(("guided_choice", {"grammar": "start: " + " | ".join(map(json.dumps, self.guided_choice))}))
        if len(asked) > 1:
            raise BadRequest(f"at most one of {', '.join(name for name, _ in asked)} may ask for a structure",
                             param=asked[1][0])
        for name in ("ignore_eos", "min_tokens", "stop", "stop_token_ids"):
            if asked and getattr(self, name):
                raise BadRequest(f"{name!r} cannot be combined with {asked[0][0]!r}: the answer ends where its "
                                 "structure does, and a stop would cut it short of valid", param=name)
        return asked[0] if asked else (None, {})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the chosen token's and this many others'

    @property
    def top_logprob_count(self) -> int | None:
        return self.logprobs


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def top_logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_plan(self) -> ToolPlan | None:
        """What the tools ask (quasar.serve.tools), checked: a choice without tools, a named function that is not
        among them, two tools of one name or a tool's parameters that are no usable schema is a 400 naming it."""
        choice = self.tool_choice
        if not self.tools:
            if choice is not None and choice != "none":
                raise BadRequest("'tool_choice' needs 'tools'", param="tool_choice")
            return None
        names = [tool.function.name for tool in self.tools]
        for i, tool in enumerate(self.tools):
            if names.index(tool.function.name) != i:
                raise BadRequest(f"two tools are named {tool.function.name!r}", param=f"tools.{i}.function.name")
            if tool.function.parameters is not None:
                try:
                    Constraint("json_schema", tool.function.parameters)
                except GrammarError as e:
                    raise BadRequest(f"invalid parameters of tool {tool.function.name!r}: {e.reason}",
                                     param=f"tools.{i}.function.parameters") from None
        if choice is None or choice == "none":
            return None if choice == "none" else ToolPlan("auto", self.tool_dicts(), parallel=self.parallel_tool_calls)
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                                 param="tool_choice")
            return ToolPlan("named", self.tool_dicts(), choice.function.name, self.parallel_tool_calls)
        return ToolPlan(choice, self.tool_dicts(), parallel=self.parallel_tool_calls)

    def tool_dicts(self) -> tuple[dict[str, Any], ...]:
        return tuple(tool.model_dump(exclude_none=True) for tool in self.tools or ())



def parse(model: type[CompletionRequest | ChatRequest], body: Any) -> Any:
    """A decoded JSON body -> a validated request, or BadRequest naming the first bad field. A null value means
    the field was not given (as the official client sends an unset field); a field this server does not
    implement is refused unless it asks for nothing (its "off" value); an unknown field is refused by name."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    fields = {}
    for name, value in body.items():
        if value is None or name in IGNORED:
            continue
        if not valid_text(value):
            raise BadRequest(f"{name!r} holds text that is not valid Unicode (a lone surrogate)", param=name)
        if name in NOT_IMPLEMENTED:
            if value in (NOT_IMPLEMENTED[name], 0, False, "", [], {}):
                continue
            raise BadRequest(f"{name!r} is not supported by this server", param=name, code="unsupported_parameter")
        fields[name] = value
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise BadRequest(f"unknown parameter {param!r}", param=param, code="unknown_parameter") from None
        raise BadRequest(f"invalid value for {param!r}: {first['msg']}", param=param) from None


def valid_text(value: Any) -> bool:
    """Whether every string in a decoded JSON value encodes as UTF-8 (JSON admits lone surrogates; text does not)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(valid_text(k) and valid_text(v) for k, v in value.items())
    if isinstance(value, list):
        return all(valid_text(v) for v in value)
    return True


def budget(requested: int | None, prompt_tokens: int, engine: Engine) -> int:
    """The tokens a request may generate, as the engine budgets them (Engine.budget): without `max_tokens`, what the
    context window holds, and no more than its KV cache fits in the server's KV budget; `max_tokens` beyond the
    context window, or whose cache the KV budget cannot hold, is refused."""
    kv_budget = engine.caches.budget
    try:
        allowed = engine.budget(prompt_tokens, requested, kv_budget)
        if requested is None or requested <= allowed.room:
            if kv_budget is not None and allowed.cache_len > kv_budget:  # an explicit max_tokens: None is fitted
                raise BadRequest(f"max_tokens {requested} with the prompt's {prompt_tokens} tokens needs a KV cache "
                                 f"of {allowed.cache_len} positions; the server's KV budget is {kv_budget}",
                                 param="max_tokens", code="context_length_exceeded")
            return allowed.new_tokens
    except KVBudgetError:
        raise BadRequest(f"the prompt's {prompt_tokens} tokens leave no room in the server's KV budget of "
                         f"{kv_budget} positions", param="messages",
                         code="context_length_exceeded") from None
    except PromptTooLongError:
        pass
    asked = requested if requested is not None else 1
    raise BadRequest(
        f"this model's maximum context length is {engine.max_context} tokens; the request needs "
        f"{prompt_tokens + asked} ({prompt_tokens} in the prompt, {asked} to generate)",
        param="max_tokens", code="context_length_exceeded",
    )
