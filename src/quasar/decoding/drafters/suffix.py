"""'suffix': like 'ngram', but matching against the text of earlier requests too (in the spirit of
SuffixDecoding, Oliaro et al. 2024), so repeated or templated outputs (an agent's tool calls, code edited again)
draft long.

Every suffix drafter of one decoder (the requests one server or LLM serves, however many run at once) shares a
SuffixStore: the finished requests' tokens (prompt + output) in an n-gram index that keeps each n-gram's most
recent occurrence and what followed it, with n up to `max_depth` (longer than prompt lookup's, since history is
large and long matches are what make templated text draft well). A request's own tokens sit in its drafter's index
until it ends, so requests in flight at the same time do not see each other's. The store holds at most
`max_history` tokens: past that, the oldest requests are dropped and the index rebuilt from the rest.
"""

from __future__ import annotations

import torch

from quasar.decoding.drafters.base import Draft, DrafterOptions
from quasar.decoding.drafters.ngram import NgramIndex
from quasar.decoding.drafters.tree_proposal import Chance, Copy, grow_tree
from quasar.model.loading import LoadedModel
from quasar.decoding.sampling import SamplingParams
from quasar.decoding.tree import DraftTree


class SuffixStore:
    """The finished requests' tokens, for every suffix drafter of one decoder: at most max_history of them."""

    def __init__(self, ngram_min: int, max_depth: int, max_history: int) -> None:
        self.index = NgramIndex(ngram_min, max_depth, keep="last")
        self.docs: list[list[int]] = []
        self.first_doc = 0  # id of docs[0]; ids keep growing as old documents are dropped
        self.max_history = max_history

    def add(self, doc: list[int]) -> None:
        self.docs.append(doc)
        self.index.add(self.first_doc + len(self.docs) - 1, doc, 0)
        if sum(len(d) for d in self.docs) > self.max_history and len(self.docs) > 1:
            while sum(len(d) for d in self.docs) > self.max_history // 2 and len(self.docs) > 1:
                self.docs.pop(0)
                self.first_doc += 1
            self.index.clear()
            for i, kept in enumerate(self.docs):
                self.index.add(self.first_doc + i, kept, 0)

    def text(self, doc_id: int) -> list[int]:
        return self.docs[doc_id - self.first_doc]


class SuffixDrafter:
    free = True  # (Drafter)

    def __init__(self, ngram_min: int = 1, max_depth: int = 8, max_history: int = 1 << 16,
                 store: SuffixStore | None = None) -> None:
        self.store = store or SuffixStore(ngram_min, max_depth, max_history)
        self.index = NgramIndex(ngram_min, max_depth, keep="last")  # the current request's tokens
        self.current: list[int] = []
        self.ngram_min, self.ngram_max = ngram_min, max_depth

    def spawn(self) -> SuffixDrafter:
        """A drafter for a concurrent request, sharing this one's store."""
        return SuffixDrafter(self.ngram_min, self.ngram_max, store=self.store)

    def reset(self) -> None:
        """A new request: the one before it (if any) goes into the store."""
        if self.current:
            self.store.add(self.current)
            self.current = []
            self.index.clear()

    def commit(self, tokens: list[int]) -> None:
        start = len(self.current)
        self.current.extend(tokens)
        self.index.add(0, self.current, start)

    def rewind(self, n: int) -> None:
        self.index.remove(0, self.current, len(self.current) - n)
        del self.current[len(self.current) - n :]

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        found = self.locate(self.current) if k > 0 else None
        if found is None:
            return Draft([])
        text, start = found
        return Draft(text[start : start + k])

    def propose_tree(self, nodes: int, width: int, chance: Chance) -> DraftTree:
        """Up to `nodes` tokens as a draft tree grown best-first (quasar.decoding.drafters.tree_proposal), copying
        from the most recent occurrences; at width 1 the tree is `propose`'s draft as a chain."""
        return grow_tree(self, self.locate, self.current, nodes, width, chance)

    def locate(self, tokens: list[int]) -> Copy | None:
        """(the text, where) the copy for the longest suffix of tokens seen before starts: its most recent
        occurrence, this request's before earlier ones'."""
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            gram = tuple(tokens[-n:])
            if gram in self.index.where:
                return self.current, self.index.where[gram][1]
            if gram in self.store.index.where:
                doc_id, start = self.store.index.where[gram]
                return self.store.text(doc_id), start
        return None

    def counts(self, gram: tuple[int, ...]) -> dict[int, int]:
        """{token: count} of what followed this n-gram in this request and in the store."""
        mine, earlier = self.index.counts(gram), self.store.index.counts(gram)
        if not earlier:
            return mine
        return {t: mine.get(t, 0) + earlier.get(t, 0) for t in {*mine, *earlier}}


def build(arg: str | None, target: LoadedModel, options: DrafterOptions) -> SuffixDrafter:
    if arg:
        raise ValueError(f"the suffix drafter takes no argument (got 'suffix:{arg}')")
    return SuffixDrafter(options.ngram_min, max(8, options.ngram_max))
