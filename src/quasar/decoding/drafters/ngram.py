"""'ngram': prompt lookup decoding (Saxena 2023; the Spec-Bench PLD and vLLM 'ngram' proposer).

The drafter matches the last n committed tokens, n from ngram_max down to ngram_min, against the
earlier prompt + generated text; at the first (longest) n that matches, it proposes up to k tokens
that followed the earliest occurrence of that n-gram. An index from n-gram to its first occurrence,
updated as tokens are committed, makes each step O(ngram_max) instead of a scan of the context.

The draft is the same at every temperature: when sampling, each position's token is drawn as plain decoding draws
it and a draft token is kept iff it is that draw (quasar.decoding.rejection's `matched_verdict`), so a copied token
is accepted with the target's probability of it and the output is plain decoding's. The index also counts every
token that followed each n-gram: a draft tree's siblings (quasar.decoding.drafters.tree_proposal) are the other
continuations by count.
"""

from __future__ import annotations

from typing import Any

import torch

from quasar.decoding.drafters.base import Draft, DrafterOptions
from quasar.model.loading import LoadedModel
from quasar.decoding.sampling import SamplingParams
from quasar.decoding.drafters.tree_proposal import Chance, Copy, grow_tree
from quasar.decoding.tree import DraftTree


class NgramIndex:
    """n-gram (ngram_min <= n <= ngram_max) -> (document, position of the token that followed it).

    An n-gram is indexed only once a token follows it, so the current suffix never matches itself.
    keep='first' remembers the earliest occurrence, 'last' the most recent one (and the ones before it, so
    `remove` brings back the one it uncovers).
    """

    def __init__(self, ngram_min: int, ngram_max: int, keep: str = "first") -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.keep_last = keep == "last"
        self.where: dict[tuple[int, ...], tuple[int, int]] = {}
        self.earlier: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # keep='last': occurrences under `where`'s
        self.followers: dict[tuple[int, ...], dict[int, int]] = {}  # n-gram -> {next token: count}

    def add(self, doc_id: int, tokens: list[int], start: int) -> None:
        """Index the n-grams that end just before each of tokens[start:]."""
        for end in range(max(start, 1), len(tokens)):
            following = tokens[end]
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                gram = tuple(tokens[end - n : end])
                if self.keep_last:
                    if gram in self.where:
                        self.earlier.setdefault(gram, []).append(self.where[gram])
                    self.where[gram] = (doc_id, end)
                else:
                    self.where.setdefault(gram, (doc_id, end))
                counts = self.followers.setdefault(gram, {})
                counts[following] = counts.get(following, 0) + 1

    def remove(self, doc_id: int, tokens: list[int], start: int) -> None:
        """Undo add(doc_id, tokens, start) for the n-grams that end just before each of tokens[start:]."""
        for end in range(len(tokens) - 1, max(start, 1) - 1, -1):
            following = tokens[end]
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                gram = tuple(tokens[end - n : end])
                if self.where.get(gram) == (doc_id, end):
                    below = self.earlier.get(gram)
                    if below:
                        self.where[gram] = below.pop()
                        if not below:
                            del self.earlier[gram]
                    else:
                        del self.where[gram]
                counts = self.followers[gram]
                counts[following] -= 1
                if not counts[following]:
                    del counts[following]
                    if not counts:
                        del self.followers[gram]

    def counts(self, gram: tuple[int, ...]) -> dict[int, int]:
        """{token: count} of what followed this n-gram (empty: nothing)."""
        return self.followers.get(gram, {})

    def lookup(self, tokens: list[int]) -> tuple[int, int] | None:
        """Where the longest indexed suffix of tokens occurred: (document, continuation start)."""
        return self.longest_suffix(self.where, tokens)

    def longest_suffix(self, table: dict[tuple[int, ...], Any], tokens: list[int]) -> Any:
        """table's entry for the longest suffix of tokens (n from ngram_max down to ngram_min) it has."""
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            found = table.get(tuple(tokens[-n:]))
            if found is not None:
                return found
        return None

    def clear(self) -> None:
        self.where.clear()
        self.earlier.clear()
        self.followers.clear()


class NgramDrafter:
    """Prompt lookup over the current request's prompt + generated tokens."""

    free = True  # (Drafter)

    def __init__(self, ngram_min: int = 1, ngram_max: int = 3) -> None:
        self.index = NgramIndex(ngram_min, ngram_max, keep="first")
        self.tokens: list[int] = []

    def spawn(self) -> NgramDrafter:
        return NgramDrafter(self.index.ngram_min, self.index.ngram_max)

    def reset(self) -> None:
        self.index.clear()
        self.tokens = []

    def commit(self, tokens: list[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(tokens)
        self.index.add(0, self.tokens, start)

    def rewind(self, n: int) -> None:
        self.index.remove(0, self.tokens, len(self.tokens) - n)
        del self.tokens[len(self.tokens) - n :]

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        found = self.index.lookup(self.tokens) if k > 0 else None
        if found is None:
            return Draft([])
        _, start = found
        return Draft(self.tokens[start : start + k])

    def propose_tree(self, nodes: int, width: int, chance: Chance) -> DraftTree:
        """Up to `nodes` tokens as a draft tree grown best-first (quasar.decoding.drafters.tree_proposal): each node's
        children are the copy's next token, then the other continuations of its context by count; at width 1 the
        tree is the greedy `propose` draft as a chain."""
        return grow_tree(self.index, self.locate, self.tokens, nodes, width, chance)

    def locate(self, tokens: list[int]) -> Copy | None:
        """(the text, where) the copy for the longest indexed suffix of tokens starts, as `propose` finds it."""
        found = self.index.lookup(tokens)
        return None if found is None else (self.tokens, found[1])


def build(arg: str | None, target: LoadedModel, options: DrafterOptions) -> NgramDrafter:
    if arg:
        raise ValueError(f"the ngram drafter takes no argument (got 'ngram:{arg}'); use --ngram-min/--ngram-max")
    return NgramDrafter(options.ngram_min, options.ngram_max)
