"""Per-request statistics, shared by plain and speculative decoding (Spec-Bench names)."""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass, field
from typing import Any


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


@dataclass
class GenerationStats:
    """What one request cost. A verify step is one verifier forward over [last, *draft];
    plain decoding is the case of empty drafts, so its mean accepted tokens is 1.0."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens a kept cache already held (prefix caching: not prefilled again)
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    verify_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify step
    forced_tokens: int = 0  # of the accepted tokens, those a grammar forced (drafted without the drafter)
    finish_reason: str = "length"
    rechecked_tokens: int = 0  # --guard: positions the float model re-scored
    recheck_changed: int = 0  # of those, positions where its token differed from the verifier's
    middle: GenerationStats | None = None  # a cascade's middle level (quasar.decoding.cascade): its own steps

    def level(self) -> dict[str, Any]:
        """This level's verify steps in brief (how a cascade reports its middle level)."""
        return {
            "verify_steps": self.verify_steps, "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens, "mean_accepted_tokens": self.mean_accepted_tokens,
            "acceptance_rate": self.acceptance_rate, "forced_tokens": self.forced_tokens,
            "draft_s": self.draft_s, "verify_s": self.verify_s,
        }

    @property
    def wall_s(self) -> float:
        """Seconds from the request to its last token, prompt processing included."""
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def forced_per_step(self) -> float:
        """Tokens a grammar forced per verify step (part of mean_accepted_tokens)."""
        return self.forced_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def other_s(self) -> float:
        return max(0.0, self.decode_s - self.draft_s - self.verify_s)

    def record_step(self, proposed: int, accepted: int, emitted: int, forced: int = 0) -> None:
        """One verify step: `proposed` draft tokens scored, `accepted` of them kept (`forced` of those forced by a
        grammar), `emitted` tokens out (accepted + the corrected or bonus token, fewer when EOS or the token limit
        cut the step)."""
        self.verify_steps += 1
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.forced_tokens += forced
        self.accept_lengths.append(emitted)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["middle"] = self.middle.level() if self.middle is not None else None
        out.update(
            wall_s=self.wall_s,
            tokens_per_s=self.tokens_per_s,
            mean_accepted_tokens=self.mean_accepted_tokens,
            acceptance_rate=self.acceptance_rate,
            forced_per_step=self.forced_per_step,
            other_s=self.other_s,
            peak_rss_mb=peak_rss_mb(),
        )
        return out
