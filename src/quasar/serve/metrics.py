"""Server metrics in the Prometheus text exposition format (no client library needed)."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from quasar.decoding.stats import GenerationStats
from quasar.machine import resident_bytes

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{edge}"}} {count}' for edge, count in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total}", f"{name}_count {self.n}"]


class Metrics:
    """Counters of requests and tokens, the speculative stats summed over requests, latency histograms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.finished: Counter[str] = Counter()  # finish reason (stop, length, cancelled) -> count
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.verify_steps = 0
        self.emitted_by_steps = 0
        self.proposed_tokens = 0
        self.accepted_tokens = 0
        self.forced_tokens = 0
        self.middle: Counter[str] = Counter()  # a cascade's middle level: verify_steps, proposed, accepted tokens
        self.latency = Histogram()
        self.first_token = Histogram()

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def record(self, stats: GenerationStats, latency_s: float, first_token_s: float | None, cancelled: bool) -> None:
        with self._lock:
            self.finished["cancelled" if cancelled else stats.finish_reason] += 1
            self.prompt_tokens += stats.prompt_tokens
            self.cached_tokens += stats.cached_tokens
            self.generation_tokens += stats.new_tokens
            self.verify_steps += stats.verify_steps
            self.emitted_by_steps += sum(stats.accept_lengths)
            self.proposed_tokens += stats.proposed_tokens
            self.accepted_tokens += stats.accepted_tokens
            self.forced_tokens += stats.forced_tokens
            if stats.middle is not None:
                self.middle.update(verify_steps=stats.middle.verify_steps, emitted=sum(stats.middle.accept_lengths),
                                   proposed_tokens=stats.middle.proposed_tokens, accepted_tokens=stats.middle.accepted_tokens)
            self.latency.observe(latency_s)
            if first_token_s is not None:
                self.first_token.observe(first_token_s)

    @property
    def mean_accepted_tokens(self) -> float:
        return self.emitted_by_steps / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    def render(self, waiting: int, running: int, kv_taken: int = 0, kv_kept: int = 0, kv_budget: int | None = None) -> str:
        with self._lock:
            lines = _family("quasar_requests_total", "counter", "HTTP requests by endpoint and status")
            lines += [f"quasar_requests_total{{endpoint={_label(e)},status={_label(s)}}} {n}"
                      for (e, s), n in sorted(self.requests.items())]
            lines += _family("quasar_generations_total", "counter", "finished generations by finish reason")
            lines += [f"quasar_generations_total{{reason={_label(r)}}} {n}" for r, n in sorted(self.finished.items())]
            for name, value, doc in (
                ("quasar_prompt_tokens_total", self.prompt_tokens, "prompt tokens processed"),
                ("quasar_prompt_cached_tokens_total", self.cached_tokens,
                 "prompt tokens a kept KV cache already held (prefix caching), not prefilled again"),
                ("quasar_generation_tokens_total", self.generation_tokens, "tokens generated"),
                ("quasar_verify_steps_total", self.verify_steps, "verifier forwards over [last, *draft]"),
                ("quasar_proposed_tokens_total", self.proposed_tokens, "draft tokens proposed"),
                ("quasar_accepted_tokens_total", self.accepted_tokens, "draft tokens accepted"),
                ("quasar_forced_tokens_total", self.forced_tokens,
                 "accepted draft tokens a structured answer's grammar forced (drafted for free)"),
                ("quasar_middle_verify_steps_total", self.middle["verify_steps"],
                 "a cascade's middle verifier (w8a8 in w8a8+bf16): its forwards over [last, *draft]"),
                ("quasar_middle_proposed_tokens_total", self.middle["proposed_tokens"],
                 "draft tokens proposed to a cascade's middle verifier"),
                ("quasar_middle_accepted_tokens_total", self.middle["accepted_tokens"],
                 "draft tokens a cascade's middle verifier accepted"),
            ):
                lines += _family(name, "counter", doc) + [f"{name} {value}"]
            for name, value, doc in (
                ("quasar_mean_accepted_tokens", self.mean_accepted_tokens, "tokens emitted per verify step"),
                ("quasar_acceptance_rate", self.acceptance_rate, "accepted / proposed draft tokens"),
                ("quasar_middle_mean_accepted_tokens",
                 self.middle["emitted"] / self.middle["verify_steps"] if self.middle["verify_steps"] else 0.0,
                 "tokens a cascade's middle verifier emitted per forward"),
                ("quasar_queue_length", waiting, "requests waiting for the worker"),
                ("quasar_requests_running", running, "requests being generated"),
                ("quasar_kv_positions_in_use", kv_taken, "KV cache positions the running requests hold"),
                ("quasar_kv_positions_kept", kv_kept, "KV cache positions kept for the next requests (prefix caching)"),
                ("quasar_kv_budget_positions", kv_budget or 0, "KV cache positions all requests may hold (0: no bound)"),
                ("quasar_resident_memory_bytes", resident_bytes(), "the server process's resident memory"),
            ):
                lines += _family(name, "gauge", doc) + [f"{name} {value}"]
            for name, hist, doc in (
                ("quasar_request_latency_seconds", self.latency, "time from submission to the last token"),
                ("quasar_time_to_first_token_seconds", self.first_token, "time from submission to the first piece"),
            ):
                lines += _family(name, "histogram", doc) + hist.lines(name)
        return "\n".join(lines) + "\n"


def _label(value: object) -> str:
    """A quoted label value, escaped as the text exposition format requires (backslash, quote, newline)."""
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def _family(name: str, kind: str, doc: str) -> list[str]:
    return [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
