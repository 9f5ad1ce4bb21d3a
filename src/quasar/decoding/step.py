"""What a decoder asks of the model: a Step (one sequence's next tokens on its cache), and the one way steps run."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple

import torch

from quasar.model.kv_cache import KVCache
from quasar.model.llama import Transformer


class Step(NamedTuple):
    """One sequence's next forward: `tokens` appended to its `cache`; logits of every token, or of the last.
    `cut`: a busy batch may run only a prefix of the tokens (at least one) and return that prefix's logits;
    `chances`: for each token after the first, the chance that its row is of use (a draft token's acceptance);
    `timed(rows, seconds)`: told what the forward that ran it cost, all of its rows (every step's in a batch);
    `tree`: a draft tree's parent row of each token (quasar.model.llama.Rows; empty: a chain). A cut keeps a prefix
    of a tree's rows too: every parent comes before its children."""

    tokens: list[int]
    cache: KVCache
    last_only: bool = False
    cut: bool = False
    chances: tuple[float, ...] = ()
    timed: Callable[[int, float], None] | None = None
    tree: tuple[int, ...] = ()

    def prefix(self, n: int) -> Step:
        """The step of its first n tokens (a busy batch's cut, a prompt's chunk)."""
        return self._replace(tokens=self.tokens[:n], tree=self.tree[:n])


def run_steps(model: Transformer, steps: Sequence[Step]) -> list[torch.Tensor]:
    """The model's forward of several steps (each one's logits as alone), then each cache records the tokens
    it now holds, so that a cache pool can hand a later prompt what it shares with them."""
    logits = model.forward_steps(steps)
    for step in steps:
        step.cache.wrote(len(step.tokens), step.tokens)
    return logits


def run_alone(model: Transformer, steps: Generator[Step, torch.Tensor, Any]) -> Any:
    """What a generator of Steps returns, each Step run at once on `model` (no batch, no cache pool: a cascade's
    middle level drives its own steps so)."""
    logits = None
    while True:
        try:
            step = steps.send(logits)
        except StopIteration as done:
            return done.value
        logits = model.forward_steps([step])[0]
