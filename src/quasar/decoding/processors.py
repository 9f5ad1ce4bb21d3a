"""Row processors: what a request does to the verifier's logits before any token is picked.

A request carries `RowProcessor`s (penalties, a logit bias, a grammar's mask, ...), built from its SamplingParams by
`processors_for` through the factories in `FACTORIES` (a new kind of processor appends its factory there). Every row
a decoder picks a token from passes through them in one place, `Processing.apply`, called by the request's Sampler
(a plain step's row, a speculative step's [last, *draft] rows, the same in a batch or alone): row i is processed as
plain decoding processes the position after the tokens so far and draft[:i], so speculative output stays plain
output under any processor. The request commits the tokens each step emits (engine.Request.emit), in order.

`Processing` also keeps the rows of the last step, after the processors, so that a request that asks for logprobs
gets the log-softmax of the row each emitted token was picked from (computed only when asked).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from quasar.decoding import rules
from quasar.decoding.grammar import GrammarMask, grammars_for
from quasar.decoding.rules import Vocab
from quasar.decoding.sampling import SamplingParams


class RowProcessor(Protocol):
    """Changes one request's verifier logits before any token is picked, row by row."""

    def apply(self, logits: torch.Tensor, history: Sequence[int], draft: Sequence[int]) -> None:
        """logits [R, V] in place; row i is the position after history + draft[:i] (history: prompt + emitted)."""

    def commit(self, tokens: Sequence[int]) -> None:
        """The tokens this step emitted (after acceptance), in order."""


ProcessorFactory = Callable[[SamplingParams, Vocab], "RowProcessor | None"]


def grammar(params: SamplingParams, vocab: Vocab) -> RowProcessor | None:
    """A structured-output request's grammar mask (quasar.decoding.grammar)."""
    return None if params.constraint is None else grammars_for(vocab).mask(params.constraint)


def grammar_of(processing: Processing | None) -> GrammarMask | None:
    """A request's grammar among its row processors, for drafting (None when it has none)."""
    processors = processing.processors if processing is not None else ()
    return next((p for p in processors if isinstance(p, GrammarMask)), None)


# each gives a request's processor of its kind, or None when its params do not ask for one; the grammar comes after
# the rules that add to logits, so that a row keeps exactly the tokens it allows, and min_tokens last, so that it
# bans the end of the output only where something else may follow
FACTORIES: list[ProcessorFactory] = [rules.logit_bias, rules.penalties, grammar, rules.min_tokens]


def processors_for(params: SamplingParams, vocab: Vocab) -> list[RowProcessor]:
    """The processors `params` asks for, in the order of FACTORIES (ValueError for a value the vocabulary refuses)."""
    return [p for factory in FACTORIES if (p := factory(params, vocab)) is not None]


class TokenLogprob(NamedTuple):
    """An emitted token's log-probability and the `top` most likely tokens of its row, (token, logprob) each."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Processing:
    """One request's processors and the token history they see; `top_logprobs` None: no logprobs kept."""

    def __init__(
        self, processors: Sequence[RowProcessor], prompt_ids: Sequence[int], top_logprobs: int | None = None
    ) -> None:
        self.processors = list(processors)
        self.history = list(prompt_ids)  # prompt + emitted
        self.top_logprobs = top_logprobs
        self.rows: torch.Tensor | None = None  # [R, V] the last step's rows, as processed
        self.logprobs: list[TokenLogprob] = []  # one per emitted token, when asked for

    def apply(self, logits: torch.Tensor, draft: Sequence[int] = ()) -> torch.Tensor:
        """logits [R, V] (row i: after the tokens so far and draft[:i]) -> the rows every processor has changed, float32
        on CPU (a copy when there is a processor or logprobs are kept: the forward's logits stay as they were)."""
        rows = logits.float().cpu()
        if self.processors or self.top_logprobs is not None:  # kept for logprobs: never the forward's own memory
            rows = rows.clone()
            for processor in self.processors:
                processor.apply(rows, self.history, draft)
        self.rows = rows
        return rows

    def apply_at(self, logits: torch.Tensor, draft: Sequence[int]) -> torch.Tensor:
        """One row [V] at the position after the tokens so far and all of `draft` -> that row processed (it takes
        the place of the last step's row there, for logprobs)."""
        rows = self.rows
        row = self.apply(logits[None].expand(len(draft) + 1, -1), draft)[-1]
        if rows is not None and len(rows) > len(draft):
            rows[len(draft)] = row
            self.rows = rows
        return row

    def commit(self, tokens: Sequence[int]) -> None:
        """The tokens a step emitted, in order: token j was picked from the last step's row j."""
        if self.top_logprobs is not None and tokens:
            assert self.rows is not None and len(self.rows) >= len(tokens)
            self.logprobs += token_logprobs(self.rows[: len(tokens)], tokens, self.top_logprobs)
        for processor in self.processors:
            processor.commit(tokens)
        self.history.extend(tokens)


def token_logprobs(rows: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """rows [n, V] -> each tokens[j]'s log-softmax in row j, with the row's `top` most likely tokens."""
    logprobs = torch.log_softmax(rows, dim=-1)  # [n, V]
    chosen = logprobs.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()  # [n]
    if top > 0:
        values, ids = logprobs.topk(min(top, rows.shape[-1]), dim=-1)  # [n, top]
        tops = [tuple((t, lp) for t, lp in zip(i, v) if lp != float("-inf"))  # a banned token is no candidate
                for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, tp) for t, lp, tp in zip(tokens, chosen, tops)]
