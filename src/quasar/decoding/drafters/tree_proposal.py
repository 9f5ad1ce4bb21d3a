"""Draft trees from an n-gram index (the ngram and suffix drafters' `propose_tree`).

A node's children, in the order they are tried (rank 0 first), are the candidates for the position after the path
to it: rank 0 continues the node's copy (the text its branch copies, as `propose` does: at the root the occurrence
the index finds for the committed tokens), then come the other tokens that followed the longest indexed suffix of
the committed tokens + the path, by count (most first, then by token id), then those of its shorter suffixes, at
most `width` in all. A child of rank
0 goes on copying the same text; a child of a later rank starts a copy where the index finds its own context. A
copy that reaches the end of its text ends a width-1 tree's branch, as it ends `propose`'s draft, so a width-1
tree is `propose`'s greedy draft as a chain; in a wider tree the branch goes on with what followed its context
most often.

The tree grows best-first (as EAGLE-2's dynamic draft trees, Li et al. 2024): each candidate node's estimate of
being accepted is P(node) = P(parent) * chance(depth, rank) with P(root) = 1, and the candidate with the largest
estimate joins next (ties: the shallower, then the lower rank, then the one offered first) until the tree has
`nodes` nodes or no candidate with an estimate above 0 is left. A node's rank r + 1 sibling is offered once rank r joined, so siblings stay in rank order, and the
order in which nodes join is the tree's node order (a parent joins before its children).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Protocol

from quasar.decoding.tree import MAX_TREE, DraftTree
from quasar.spec import MAX_DRAFT


class Continuations(Protocol):
    """What followed each n-gram: an NgramIndex, or a suffix drafter's request and store together."""

    ngram_min: int
    ngram_max: int

    def counts(self, gram: tuple[int, ...]) -> dict[int, int]: ...


Copy = tuple[list[int], int]  # (the text a branch copies, where the next token to copy is)
Locate = Callable[[list[int]], Copy | None]  # tokens -> where the index finds their longest suffix, if anywhere
Chance = Callable[[int, int], float]  # (depth from 1, rank from 0) -> the estimate that such a node is accepted


def grow_tree(index: Continuations, locate: Locate, context: list[int], nodes: int, width: int,
              chance: Chance) -> DraftTree:
    """Up to `nodes` nodes, at most `width` children each and MAX_DRAFT deep, picked best-first from the
    committed tokens `context`; each node's estimate P(node) goes into the tree's chances."""
    if not 0 <= nodes <= MAX_TREE or width < 1:
        raise ValueError(f"a draft tree takes 0 to {MAX_TREE} nodes and width >= 1, got nodes={nodes}, width={width}")
    tree = Growth(index, locate, width)
    tree.open(-1, context[-index.ngram_max :], locate(context) if nodes else None)
    offers: list[tuple[float, int, int, int, int]] = []  # (-P, depth, rank, offered, parent) per candidate node
    tree.offer(offers, -1, 0, 1, chance)
    while offers and len(tree.tokens) < nodes:
        minus, depth, rank, _, parent = heapq.heappop(offers)
        node = tree.join(parent, rank, -minus)
        tree.offer(offers, parent, rank + 1, depth, chance)
        if depth < MAX_DRAFT:
            tree.offer(offers, node, 0, depth + 1, chance)
    return DraftTree(tree.tokens, tree.parents, tree.chances)


class Growth:
    """A tree being grown: its nodes so far, and for each of them (and the root, -1) its context tail, estimate
    and children's tokens in rank order."""

    def __init__(self, index: Continuations, locate: Locate, width: int) -> None:
        self.index, self.locate, self.width = index, locate, width
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.chances: list[float] = []
        self.estimate: dict[int, float] = {-1: 1.0}
        self.tail: dict[int, list[int]] = {}  # node -> the last ngram_max tokens of its context
        self.copy: dict[int, Copy | None] = {}
        self.ranked: dict[int, list[int]] = {}  # node -> its children's tokens, rank 0 first
        self.offered = 0

    def open(self, node: int, tail: list[int], copy: Copy | None) -> None:
        """Record a node's context and copy, and rank its children."""
        self.tail[node], self.copy[node] = tail, copy
        self.ranked[node] = self.rank(tail, copy)

    def rank(self, tail: list[int], copy: Copy | None) -> list[int]:
        """The children's tokens: the copy's next one, then the other continuations of tail's longest indexed suffix
        by count, then those of its shorter suffixes (a long match often has one continuation only)."""
        copying = copy is not None and copy[1] < len(copy[0])
        if not copying and self.width == 1:  # a chain ends where its copy does, as `propose`'s draft
            return []
        ranked = [copy[0][copy[1]]] if copying else []  # a tree's branch goes on with what followed most often
        index = self.index
        for n in range(min(index.ngram_max, len(tail)), index.ngram_min - 1, -1):
            if len(ranked) == self.width:
                break
            counts = index.counts(tuple(tail[-n:]))
            ranked += [t for t in sorted(counts, key=lambda t: (-counts[t], t)) if t not in ranked][: self.width - len(ranked)]
        return ranked

    def offer(self, offers: list[tuple[float, int, int, int, int]], parent: int, rank: int, depth: int,
              chance: Chance) -> None:
        """Make parent's child of this rank a candidate, if parent has one and its estimate is above 0."""
        estimate = self.estimate[parent] * chance(depth, rank) if rank < len(self.ranked[parent]) else 0.0
        if estimate > 0:
            heapq.heappush(offers, (-estimate, depth, rank, self.offered, parent))
            self.offered += 1

    def join(self, parent: int, rank: int, estimate: float) -> int:
        """Add parent's child of this rank to the tree with its estimate P; its index."""
        node, token = len(self.tokens), self.ranked[parent][rank]
        self.tokens.append(token)
        self.parents.append(parent)
        self.estimate[node] = estimate
        self.chances.append(estimate)
        tail = [*self.tail[parent], token][-self.index.ngram_max :]
        copy = self.copy[parent]
        copying = rank == 0 and copy is not None and copy[1] < len(copy[0])
        self.open(node, tail, (copy[0], copy[1] + 1) if copying else self.locate(tail))
        return node
