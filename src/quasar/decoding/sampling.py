"""SamplingParams and the logits -> probabilities -> token path shared by target and drafter.

One rule decides which tokens survive the filters (`filtered_weights`): temperature, then top-k, top-p over
what top-k kept, then min-p (Hugging Face's and llama.cpp's order). Each filter keeps the tokens whose logit
reaches a per-row threshold, so the surviving distribution is w = exp((logit - max) / T) on the kept tokens
and 0 elsewhere, normalised. The verify step reads it through `TargetRows`, one row at a time as rejection
sampling reaches it, in buffers the request reuses; no step sorts the vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from quasar.model.execution import ON_TORCH, ExecutionPlan

if TYPE_CHECKING:
    from quasar.decoding.grammar import Constraint

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes (a negative seed wraps around)
MAX_LOGPROBS = 20  # the most likely tokens a request may ask to see at each position (OpenAI's limit)
MAX_BIAS = 100.0  # a logit bias lies in [-MAX_BIAS, MAX_BIAS] (OpenAI's limit)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_seed(seed: object) -> None:
    """ValueError unless `seed` is an integer torch can seed a generator with."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed must be an integer from {SEED_MIN} to {SEED_MAX}, got {seed!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 disable those filters.

    The rules below change the verifier's logits before any filter (quasar.decoding.rules; every one off by default):
    `logit_bias` adds to given tokens' logits ({token id: bias}, kept as sorted pairs); `presence_penalty` and
    `frequency_penalty` subtract from the logit of each token generated so far (once, and once per occurrence);
    `repetition_penalty` divides a positive logit (multiplies a negative one) of each token in the prompt or
    generated so far; `min_tokens` bans EOS and `stop_token_ids` until that many tokens are generated.
    `stop_token_ids` end the output like EOS (even with ignore_eos); the stopping token counts among the
    output's tokens, its text is not part of the output's text. `logprobs` k: each output token's log-probability
    and the k most likely tokens at its position (None: none kept).

    Structured output (quasar.decoding.grammar), at most one of: `json_schema` (a dict, its JSON text or a pydantic
    model class: the answer is JSON that validates against it), `json_object` (any JSON object), `regex` (the
    answer matches it whole), `grammar` (a Lark grammar in llguidance's dialect, or GBNF). Checked when made: a bad one is a
    ValueError naming the field. `constraint` holds it compiled."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    json_schema: Any = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    constraint: Constraint | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None:
            check_seed(self.seed)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        self._check_rules()
        object.__setattr__(self, "constraint", self._constraint())

    def _constraint(self) -> Constraint | None:
        """The structured-output fields, compiled (None when none is set)."""
        given = {"json_schema": self.json_schema is not None, "regex": self.regex is not None,
                 "grammar": self.grammar is not None, "json_object": bool(self.json_object)}
        chosen = [name for name, on in given.items() if on]
        if not chosen:
            return None
        if len(chosen) > 1:
            raise ValueError(f"give at most one of json_schema, regex, grammar, json_object; got {', '.join(chosen)}")
        if self.ignore_eos:  # (min_tokens may: it yields where the grammar allows only the end, quasar.decoding.rules)
            raise ValueError(f"ignore_eos cannot be combined with {chosen[0]}: the answer ends where the grammar does")
        from quasar.decoding.grammar import Constraint

        kind = chosen[0]
        text = {"json_schema": self.json_schema, "regex": self.regex, "grammar": self.grammar}.get(kind, "")
        if kind in ("regex", "grammar") and not isinstance(text, str):
            raise ValueError(f"{kind} must be a string, got {type(text).__name__}")
        return Constraint(kind, text)

    def _check_rules(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2 <= value <= 2):
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty <= 10):
            raise ValueError(f"repetition_penalty must be a number in (0, 10], got {self.repetition_penalty!r}")
        bias = dict(self.logit_bias)  # a mapping or pairs
        for token, value in bias.items():
            if not is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not (isinstance(value, (int, float)) and -MAX_BIAS <= value <= MAX_BIAS):
                raise ValueError(f"logit_bias values must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {value!r}")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(v)) for t, v in bias.items())))
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an integer from 0 to max_new_tokens ({self.max_new_tokens}), "
                             f"got {self.min_tokens!r}")
        stop_ids = tuple(self.stop_token_ids)
        if not all(is_int(t) and t >= 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS} (or None), got {self.logprobs!r}")

    def for_choice(self, i: int) -> SamplingParams:
        """The params of choice i of several sampled for one prompt: choice i is seeded with seed + i (wrapping around
        within the seeds torch takes), so seeded choices differ from each other and each is reproducible."""
        if self.seed is None or i == 0:
            return self
        seed = self.seed + i
        return replace(self, seed=seed - 2**64 if seed > SEED_MAX else seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


NUCLEUS_START = 64  # candidates the top-p cut looks at first; it looks 4x further while the cut lies beyond


def filtered_weights(logits: torch.Tensor, params: SamplingParams, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] float32 -> unnormalised weights [R, V] (into `out` when given) of the sampling distribution
    at temperature > 0: exp((logit - max) / T) where every filter keeps the token, 0 elsewhere."""
    top = logits.amax(-1, keepdim=True)  # [R, 1]
    weights = torch.sub(logits, top, out=out).mul_(1.0 / params.temperature).exp_()  # [R, V]
    keep_from = lowest_kept(logits, params, lambda: weights.sum(-1, keepdim=True))
    if keep_from is not None:
        weights.masked_fill_(logits < keep_from, 0.0)
    return weights


def weights_and_sums(logits: torch.Tensor, params: SamplingParams, out: torch.Tensor, kernel: Any = None) -> list[float]:
    """filtered_weights(logits, params, out) [R, V], returning each row's sum: on quasar's kernel for float32 CPU
    rows (one pass for exp((logit - max) / T) and the sums, one for the filters' cut, instead of about ten
    tensor operations, each slow right after a forward has streamed the weights through the caches)."""
    kernel = on_cpu(kernel, logits)
    if kernel is None:
        return filtered_weights(logits, params, out).sum(-1).tolist()
    sums = kernel.sampling_weights(logits, out, 1.0 / params.temperature)
    keep_from = None
    if params.top_k > 0 or params.top_p < 1:  # a selection in the row's head (or one octave), no torch.topk
        keep_from = kernel.filter_cuts(logits, out, params.top_k, params.top_p)
    keep_from = with_min_p(keep_from, logits, params)
    return sums if keep_from is None else kernel.keep_weights(logits, out, keep_from)


def lowest_kept(logits: torch.Tensor, params: SamplingParams, mass_of_all: Callable[[], torch.Tensor]
                ) -> torch.Tensor | None:
    """The lowest logit the filters keep [R, 1] (top-k, then top-p over what top-k kept, then min-p), None when no
    filter is on; mass_of_all() gives the rows' summed weights [R, 1] (top-p without top-k needs them)."""
    keep_from = None  # [R, 1] the lowest kept logit
    if params.top_k > 0:
        kept = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values  # [R, top_k] descending
        keep_from = kept[:, -1:]
    if params.top_p < 1:
        top = logits.amax(-1, keepdim=True)  # [R, 1]
        inv_t = 1.0 / params.temperature
        if params.top_k > 0:
            mass = (kept - top).mul_(inv_t).exp_().sum(-1, keepdim=True)  # [R, 1] what top-k kept
        else:
            mass = mass_of_all()
        keep_from = nucleus_start(logits, top, inv_t, mass, params)
    return with_min_p(keep_from, logits, params)


def with_min_p(keep_from: torch.Tensor | None, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """The lowest kept logit [R, 1] once min-p (a weight of at least min_p times the top token's) joins the other
    filters' `keep_from` (None: no other filter)."""
    if params.min_p <= 0:
        return keep_from
    inv_t = 1.0 / params.temperature  # as the weights exp((logit - top) * inv_t) have it
    relative = logits.amax(-1, keepdim=True) + math.log(params.min_p) / inv_t  # [R, 1]
    return relative if keep_from is None else torch.maximum(keep_from, relative)


def nucleus_start(logits: torch.Tensor, top: torch.Tensor, inv_t: float, mass: torch.Tensor,
                  params: SamplingParams) -> torch.Tensor:
    """The lowest logit top-p keeps [R, 1]: in descending order a token is kept while the mass of the tokens
    before it is below top_p of `mass` (the top-k set's). A partial selection of the leading candidates,
    widened until the cut falls inside it, replaces a sort of the vocabulary."""
    V = logits.shape[-1]
    n = min(params.top_k or NUCLEUS_START, V)
    while True:
        leading = torch.topk(logits, n, dim=-1).values  # [R, n] descending
        weights = (leading - top).mul_(inv_t).exp_()  # [R, n] the same arithmetic as filtered_weights
        before = weights.cumsum(-1) - weights  # mass of the tokens ahead of each
        kept = (before < params.top_p * mass).sum(-1, keepdim=True)  # [R, 1], >= 1
        if n == V or params.top_k > 0 or bool((kept < n).all()):
            return leading.gather(-1, kept - 1)
        n = min(V, 4 * n)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] float32 after the filters (greedy: one-hot at the argmax)."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    weights = filtered_weights(logits.reshape(-1, logits.shape[-1]), params).view(logits.shape)
    return weights / weights.sum(-1, keepdim=True)


def draw(weights: torch.Tensor, generator: torch.Generator, scratch: torch.Tensor | None = None,
         kernel: Any = None) -> int | None:
    """One token from unnormalised weights [V] by inverting their running sum at one uniform number (summed in
    float64, as torch.multinomial does); None when every weight is 0. On quasar's kernel for float32 CPU weights
    (one call instead of four tensor operations), where the uniform number is drawn first, also for weights
    that turn out to be all 0."""
    kernel = on_cpu(kernel, weights)
    if kernel is not None and weights.is_contiguous():
        token = kernel.draw_index(weights, float(torch.rand(1, generator=generator, dtype=torch.float64)))
        return None if token < 0 else token
    running = torch.cumsum(weights, 0, dtype=torch.float64, out=scratch)  # [V]
    total = running[-1]
    if not total > 0:
        return None
    at = torch.rand(1, generator=generator, dtype=torch.float64) * total
    token = int(torch.searchsorted(running, at, right=True))
    return token if token < weights.shape[0] else int(weights.nonzero()[-1])  # u * total rounded up to total


def on_cpu(kernel: Any, t: torch.Tensor) -> Any:
    """`kernel` (quasar's kernel module, from a model's plan) for work on t where t is a float32 CPU tensor, else
    None (torch does the work)."""
    return kernel if kernel is not None and t.device.type == "cpu" and t.dtype == torch.float32 else None


def argmax_rows(logits: torch.Tensor, kernel: Any = None) -> torch.Tensor:
    """logits [R, V] -> torch.argmax(logits, -1) [R] int64, the same indices: on quasar's kernel for float32 CPU rows
    (torch's took 90-140 us per 49k-token row on 2 cores, the kernel about 10), else torch."""
    kernel = on_cpu(kernel, logits)
    return logits.argmax(-1) if kernel is None else kernel.argmax_rows(logits)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """probs [..., V] -> token ids [...]; exact argmax when a row is one-hot."""
    flat = probs.reshape(-1, probs.shape[-1]).float().cpu()
    tokens = [draw(row, generator) for row in flat]
    return torch.tensor(tokens, dtype=torch.int64).reshape(probs.shape[:-1])


class TargetRows:
    """The verifier's sampling distributions for the rows [R, V] of one forward, each computed when rejection
    sampling first needs it (a step that rejects its first draft token computes one row, not k + 1)."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams, weights: torch.Tensor,
                 residual: torch.Tensor, scratch: torch.Tensor, kernel: Any = None) -> None:
        self.logits = logits  # [R, V] float32
        self.kernel = kernel  # quasar's kernel module (the model's plan), or None
        self.params = params
        self.weights = weights  # [R, V] buffer
        self.residual = residual  # [V] buffer
        self.scratch = scratch  # [V] float64 buffer
        self.totals: list[float | None] = [None] * logits.shape[0]

    def row(self, i: int) -> tuple[torch.Tensor, float]:
        """(weights [V], their sum) of row i."""
        total = self.totals[i]
        if total is None:
            total = self.totals[i] = weights_and_sums(self.logits[i : i + 1], self.params, self.weights[i : i + 1],
                                                             self.kernel)[0]
        return self.weights[i], total

    def prob(self, i: int, token: int) -> float:
        weights, total = self.row(i)
        return float(weights[token]) / total

    def probs(self, i: int) -> torch.Tensor:
        """Row i's probabilities [V] (a new tensor)."""
        weights, total = self.row(i)
        return weights / total

    def sample(self, i: int, generator: torch.Generator) -> int:
        token = draw(self.row(i)[0], generator, self.scratch, self.kernel)
        assert token is not None  # the top token always survives the filters
        return token

    def sample_residual(self, i: int, remove: Callable[[torch.Tensor, float], None], generator: torch.Generator) -> int:
        """A token from normalise(max(0, target_i - draft_i)): `remove(weights, total)` subtracts the draft's
        distribution, scaled to total, from a copy of row i's weights in place (the row stays as it was). A
        residual of 0 (target == draft, where rejection has probability 0 but for rounding) falls back to the
        target row."""
        weights, total = self.row(i)
        residual = self.residual.copy_(weights)
        remove(residual, total)
        return self.sample_left(i, residual, generator)

    def sample_left(self, i: int, residual: torch.Tensor, generator: torch.Generator) -> int:
        """A token from residual [V] (row i's weights less the drafts'); from row i itself where nothing is left."""
        token = draw(residual, generator, self.scratch, self.kernel)
        return self.sample(i, generator) if token is None else token


class RowsProcessing(Protocol):
    """A request's row processors as the sampler calls them (quasar.decoding.processors.Processing)."""

    def apply(self, logits: torch.Tensor, draft: Sequence[int] = ()) -> torch.Tensor: ...

    def apply_at(self, logits: torch.Tensor, draft: Sequence[int]) -> torch.Tensor: ...


class Sampler:
    """Per-request sampling state: the generator and the buffers every step reuses (no per-step allocation of
    vocabulary-sized tensors). `plan`: the verifier's, whose kernel module (if any) runs the row operations;
    `processing`: the request's row processors, which every row passes through before a token is picked."""

    def __init__(self, params: SamplingParams, plan: ExecutionPlan = ON_TORCH,
                 processing: RowsProcessing | None = None) -> None:
        self.params = params
        self.processing = processing
        self.kernel = plan.kernel
        self.generator = params.generator()
        self.weights = torch.empty(0)
        self.residual = torch.empty(0)
        self.scratch = torch.empty(0, dtype=torch.float64)

    def rows(self, logits: torch.Tensor) -> TargetRows:
        """logits [R, V] (any device) -> TargetRows on CPU."""
        logits = logits.float().cpu()
        R, V = logits.shape
        if self.weights.shape[0] < R or self.weights.shape[1] != V:
            self.weights = torch.empty(max(R, 8), V)
            self.residual = torch.empty(V)
            self.scratch = torch.empty(V, dtype=torch.float64)
        return TargetRows(logits, self.params, self.weights[:R], self.residual, self.scratch, self.kernel)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V] -> each row's argmax [R] (argmax_rows)."""
        return argmax_rows(logits, self.kernel)

    def processed(self, logits: torch.Tensor, draft: Sequence[int] = ()) -> torch.Tensor:
        """logits [R, V] as the request's processors leave them (row i: after the tokens so far and draft[:i])."""
        return logits if self.processing is None else self.processing.apply(logits, draft)

    def next_token(self, logits: torch.Tensor) -> int:
        """logits [V] of the position after the tokens so far -> one token id (the argmax when greedy)."""
        return self.pick(self.processed(logits[None])[0])

    def picked_from(self, logits: torch.Tensor) -> torch.Tensor:
        """The rows a step's tokens were picked from: its logits [R, V] as the processors left them (`processed`
        ran on them already; without processors the logits themselves)."""
        if self.processing is None or self.processing.rows is None:
            return logits
        return self.processing.rows

    def repick(self, logits: torch.Tensor, draft: Sequence[int]) -> int:
        """next_token for the position after the tokens so far and `draft` of a step whose rows were processed
        already, from other logits [V] (a re-score); that row takes the place of the step's row there."""
        if self.processing is not None:
            logits = self.processing.apply_at(logits, draft)
        return self.pick(logits)

    def pick(self, logits: torch.Tensor) -> int:
        """logits [V], processed -> one token id (the argmax when greedy)."""
        if self.params.greedy:
            return int(self.argmax(logits[None])[0])
        return self.rows(logits[None]).sample(0, self.generator)
