"""The OpenAI response objects of one request: the whole response, its stream chunks, usage and finish reasons."""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

from quasar.decoding.outputs import RequestOutput
from quasar.decoding.processors import TokenLogprob
from quasar.decoding.stats import GenerationStats
from quasar.serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from quasar.serve.tools import Delta, ToolReply
from quasar.version import __version__


def system_fingerprint(weights: str, engine_path: str) -> str:
    """OpenAI's `system_fingerprint`: what computes the answers (quasar's version, the weights' sha256, the kernel
    paths), so that a client can tell when the same request may be answered otherwise."""
    return "fp_" + hashlib.sha256(f"{__version__}\n{weights}\n{engine_path}".encode()).hexdigest()[:10]


def finish_reason(completion: RequestOutput, reply: ToolReply | None) -> str:
    """The completion's, but "tool_calls" for an answer that ended in tool calls."""
    if reply is not None and reply.calls and completion.finish_reason == "stop":
        return "tool_calls"
    return completion.finish_reason


def usage(completions: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI usage plus the speculative statistics of a request's choices: the prompt counted once, the
    completion tokens and the verify steps of every choice."""
    first = completions[0].stats  # the other choices start from its prefill (quasar.decoding.batch.Batch.admit)
    total = GenerationStats(prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens)
    for stats in (c.stats for c in completions):
        total.new_tokens += stats.new_tokens
        total.proposed_tokens += stats.proposed_tokens
        total.accepted_tokens += stats.accepted_tokens
        total.forced_tokens += stats.forced_tokens
        total.accept_lengths += stats.accept_lengths
        total.decode_s = max(total.decode_s, stats.wall_s)  # the choices run together
    return {
        "prompt_tokens": total.prompt_tokens,
        "completion_tokens": total.new_tokens,
        "total_tokens": total.prompt_tokens + total.new_tokens,
        "prompt_tokens_details": {"cached_tokens": total.cached_tokens},  # prefix caching (kv_cache.CachePool)
        "speculative": {
            "verify_steps": len(total.accept_lengths),
            "proposed_tokens": total.proposed_tokens,
            "accepted_tokens": total.accepted_tokens,
            "mean_accepted_tokens": total.mean_accepted_tokens,
            "acceptance_rate": total.acceptance_rate,
            "forced_tokens": total.forced_tokens,
            "tokens_per_s": total.tokens_per_s,
        },
    }


class Envelope:
    """Builds the response objects of one request (same id, timestamp and system fingerprint in every chunk);
    `texts` writes the tokens of logprobs."""

    def __init__(self, model: str, chat: bool, texts: TokenTexts | None = None, fingerprint: str | None = None
                 ) -> None:
        self.model, self.chat, self.texts, self.fingerprint = model, chat, texts, fingerprint
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # a streamed completion choice's characters so far (text_offset)

    def _wrap(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def logprobs(self, logprobs: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any] | None:
        if logprobs is None or self.texts is None:
            return None
        if self.chat:
            return chat_logprobs(logprobs, self.texts)
        out = completion_logprobs(logprobs, self.texts, self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + sum(len(token) for token in out["tokens"])
        return out

    def full(self, completions: list[RequestOutput], replies: list[ToolReply] | None = None) -> dict[str, Any]:
        """The whole response; `replies`: each choice's answer read as tool calls (quasar.serve.tools)."""
        choices = []
        for i, completion in enumerate(completions):
            choice: dict[str, Any] = {"index": i}
            reply = replies[i] if replies else None
            if self.chat:
                choice["message"] = {"role": "assistant", "content": completion.text}
                if reply is not None and reply.calls:
                    choice["message"] = {"role": "assistant", "content": reply.content if reply.content.strip() else
                                         None, "tool_calls": reply.calls}
            else:
                choice["text"] = completion.text
            choice |= {"logprobs": self.logprobs(completion.logprobs, i),
                       "finish_reason": finish_reason(completion, reply)}
            choices.append(choice)
        return self._wrap(choices, chunk=False) | {"usage": usage(completions)}

    def chunk(self, piece: str | None, finish_reason: str | None = None, index: int = 0,
              logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        """One choice's chunk: text, the finish reason, the logprobs of new tokens."""
        if self.chat:
            choice: dict[str, Any] = {"index": index, "delta": {} if piece is None else {"content": piece}}
        else:
            choice = {"index": index, "text": piece or ""}
        choice |= {"logprobs": self.logprobs(logprobs, index), "finish_reason": finish_reason}
        return self._wrap([choice], chunk=True)

    def role_chunk(self, index: int, content: str | None = "") -> dict[str, Any]:
        """A chat choice's first chunk: the role, and content "" (None where the reply opens with a tool call)."""
        choice = {"index": index, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                  "finish_reason": None}
        return self._wrap([choice], chunk=True)

    def delta_chunk(self, delta: Delta, index: int = 0) -> dict[str, Any]:
        """A chat chunk of one piece of a choice's reply read as tool calls: content, a call's start, or its
        arguments."""
        if delta.index is None:
            return self.chunk(delta.text, index=index)
        call: dict[str, Any] = {"index": delta.index, "function": {"arguments": delta.text}}
        if delta.name is not None:
            call = {"index": delta.index, "id": delta.id, "type": "function",
                    "function": {"name": delta.name, "arguments": ""}}
        choice = {"index": index, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}
        return self._wrap([choice], chunk=True)

    def usage_chunk(self, completions: list[RequestOutput]) -> dict[str, Any]:
        return self._wrap([], chunk=True) | {"usage": usage(completions)}
