"""The one result type: what a request gave back, from the engine, the Python API, the server or a bench peer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quasar.decoding.processors import TokenLogprob
from quasar.decoding.prompt import Messages
from quasar.decoding.stats import GenerationStats


@dataclass
class RequestOutput:
    """One request: the prompt as given (None when only its ids were) and its ids, the generated text and
    token ids (and their logprobs, when asked for), and what it cost. The engine fills it in while the request runs."""

    prompt: str | Messages | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the params ask for logprobs


    @property
    def finish_reason(self) -> str:
        """'stop' (EOS or a stop string) or 'length' (the token budget or the context window)."""
        return self.stats.finish_reason

    def to_dict(self) -> dict[str, Any]:
        logprobs = {} if self.logprobs is None else {"logprobs": [lp._asdict() for lp in self.logprobs]}
        return {
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            **logprobs,
            "stats": self.stats.to_dict(),
        }
