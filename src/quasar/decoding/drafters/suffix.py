"""'suffix': like 'ngram', but matching against the text of earlier requests of this process too
(in the spirit of SuffixDecoding, Oliaro et al. 2024), so repeated or templated outputs draft long.

All requests served (prompt + output) and the current one share one n-gram index that keeps the most
recent occurrence of each n-gram, with n up to `max_depth` (longer than prompt lookup's, since history
is large and long matches are what make templated text draft well). History is bounded: once it holds
more than `max_history` tokens the index is rebuilt from the most recent requests.
"""

from __future__ import annotations

import torch

from quasar.decoding.drafters.base import Draft, DrafterOptions
from quasar.decoding.drafters.ngram import NgramIndex
from quasar.decoding.drafters.tree_proposal import Chance, Copy, grow_tree
from quasar.model.loading import LoadedModel
from quasar.decoding.sampling import SamplingParams
from quasar.decoding.tree import DraftTree


class SuffixDrafter:
    free = True  # (Drafter)

    def __init__(self, ngram_min: int = 1, max_depth: int = 8, max_history: int = 1 << 16) -> None:
        self.index = NgramIndex(ngram_min, max_depth, keep="last")
        self.docs: list[list[int]] = [[]]  # earlier requests, then the current one (last)
        self.first_doc = 0  # id of docs[0]; ids keep growing as old documents are dropped
        self.max_history = max_history

    @property
    def current(self) -> list[int]:
        return self.docs[-1]

    def spawn(self) -> SuffixDrafter:
        """A drafter for a concurrent request: it starts from this one's history as it stands, then keeps its
        own (requests served at the same time do not see each other's tokens)."""
        other = SuffixDrafter(self.index.ngram_min, self.index.ngram_max, self.max_history)
        other.docs = [list(doc) for doc in self.docs if doc] + [[]]
        other.rebuild()
        return other

    def reset(self) -> None:
        if self.current:
            self.docs.append([])
            self.forget_old()

    def forget_old(self) -> None:
        if sum(len(d) for d in self.docs) <= self.max_history or len(self.docs) <= 2:
            return
        while sum(len(d) for d in self.docs) > self.max_history // 2 and len(self.docs) > 2:
            self.docs.pop(0)
            self.first_doc += 1
        self.rebuild()

    def rebuild(self) -> None:
        self.index.clear()
        for i, doc in enumerate(self.docs):
            self.index.add(self.first_doc + i, doc, 0)

    def commit(self, tokens: list[int]) -> None:
        start = len(self.current)
        self.current.extend(tokens)
        self.index.add(self.first_doc + len(self.docs) - 1, self.current, start)

    def rewind(self, n: int) -> None:
        doc_id = self.first_doc + len(self.docs) - 1
        self.index.remove(doc_id, self.current, len(self.current) - n)
        del self.current[len(self.current) - n :]

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        found = self.index.lookup(self.current) if k > 0 else None
        if found is None:
            return Draft([])
        doc_id, start = found
        return Draft(self.docs[doc_id - self.first_doc][start : start + k])

    def propose_tree(self, nodes: int, width: int, chance: Chance) -> DraftTree:
        """Up to `nodes` tokens as a draft tree grown best-first (quasar.decoding.drafters.tree_proposal), copying
        from the most recent occurrences; at width 1 the tree is `propose`'s draft as a chain."""
        return grow_tree(self.index, self.locate, self.current, nodes, width, chance)

    def locate(self, tokens: list[int]) -> Copy | None:
        """(the text, where) the copy for the longest indexed suffix of tokens starts, as `propose` finds it."""
        found = self.index.lookup(tokens)
        return None if found is None else (self.docs[found[0] - self.first_doc], found[1])


def build(arg: str | None, target: LoadedModel, options: DrafterOptions) -> SuffixDrafter:
    if arg:
        raise ValueError(f"the suffix drafter takes no argument (got 'suffix:{arg}')")
    return SuffixDrafter(options.ngram_min, max(8, options.ngram_max))
