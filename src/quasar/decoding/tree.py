"""Draft trees and their verification (SpecInfer's tree-based speculative inference, Miao et al. 2024).

A drafter may propose several continuations at once as a tree of tokens rooted at the last committed token: each
path from the root is one draft, and siblings are alternatives for the same position. The verifier scores the
root and every node in one forward (a node attends to its ancestors only), giving target row 0 for the root and
row i + 1 for node i: the distribution of the token after the path to that node. The walk then starts at the root:

- the current node's row is drawn as plain decoding draws a token (one uniform number, quasar.decoding.rejection's
  `matched_verdict`);
- an *accepted* node is the child of the current node equal to that draw; the walk descends into it;
- a *recovered* token ends the walk when no child equals the draw: the draw itself;
- a *bonus* token ends the walk at a node without children (an accepted leaf, or the root of an empty tree): it is
  that node's draw.

Every step emits the accepted path and one more token. Why it is exact: the walk reads the row of node x only once
x was emitted, and that row is the target's distribution given everything emitted so far; at each visited node the
emitted token is a draw from that row, whatever the candidates (they are fixed before verification). So each
emitted token follows the target given the ones before it, and it is the token plain decoding draws from the same
generator. Child j is accepted with probability p(t_j), the multi-candidate rule's law for distinct deterministic
candidates (quasar.decoding.multi_candidate: sampling the row without replacement), with one uniform number a
position instead of one a candidate. Greedy decoding reduces to the argmax walk: descend into the child equal to
the row's argmax while there is one, then emit the argmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quasar.decoding.multi_candidate import Choice, greedy_choice
from quasar.decoding.sampling import TargetRows

MAX_TREE = 15  # draft nodes a tree verify step takes at most (16 rows)


@dataclass(frozen=True)
class DraftTree:
    """A drafter's proposal for several positions: nodes in an order where every parent comes before its children;
    siblings are distinct tokens, in the order they are tried (most likely first)."""

    tokens: list[int]  # [n] the nodes' tokens
    parents: list[int]  # [n] each node's parent node; -1: a child of the root (the last committed token)
    chances: list[float] = field(default_factory=list)  # [n] or []: the drafter's estimate that each node is accepted

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n:
            raise ValueError(f"a draft tree needs one parent per token, got {n} tokens and {len(self.parents)} parents")
        if self.chances and len(self.chances) != n:
            raise ValueError(f"a draft tree's chances must be empty or one per token, got {len(self.chances)} for {n}")
        seen: set[tuple[int, int]] = set()
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent must be a node before it or -1 (the root), got {parent}")
            if (parent, token) in seen:
                raise ValueError(f"siblings must be distinct tokens: node {i} repeats token {token} under {parent}")
            seen.add((parent, token))

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        """A single draft: node i's parent is node i - 1."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self) - 1))

    def depths(self) -> list[int]:
        """[n] each node's depth; a child of the root has depth 1."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def children(self, node: int) -> list[int]:
        """The children of `node` (-1: of the root), in index order (the order they are tried)."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node`."""
        nodes: list[int] = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def prefix(self, n: int) -> DraftTree:
        """The first n nodes: a tree too, since parents come before their children."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.chances[:n])

    def rows(self, feed: int = 1) -> tuple[int, ...]:
        """The parent row of each row of a verify step over [*feed tokens, *nodes] (-1 for row 0: it follows the
        cache): the feed rows are a chain, a child of the root follows the last feed row, node i's row is feed + i."""
        return (*range(-1, feed - 1), *(feed - 1 if parent < 0 else feed + parent for parent in self.parents))


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # the accepted nodes, depth 1 first
    token: int  # the token after them: recovered (a child was rejected) or bonus (no children were left to try)

    @property
    def accepted(self) -> int:
        return len(self.path)


def greedy_tree_verdict(
    tree: DraftTree,
    argmax: list[int],  # [n + 1] the argmax of the target rows [root, *nodes]
) -> TreeVerdict:
    """sample_tree_verdict at temperature 0: descend into the child equal to the current row's argmax while there is
    one (greedy_choice), then emit that row's argmax."""
    return walk(tree, lambda tokens, row: greedy_choice(tokens, argmax[row]))


def sample_tree_verdict(
    tree: DraftTree,  # n deterministic nodes
    target: TargetRows,  # n + 1 rows [root, *nodes], after temperature / top-k / top-p / min-p
    generator: torch.Generator,  # the request's
) -> TreeVerdict:
    """Walk from the root, at each node its row's draw: descend into the child equal to it, else stop with it. The
    emitted tokens follow the target rows exactly, as plain decoding's draws from the same generator."""
    return walk(tree, lambda tokens, row: greedy_choice(tokens, target.sample(row, generator)))


def walk(tree: DraftTree, choose: Callable[[list[int], int], Choice]) -> TreeVerdict:
    """From the root down: choose(children's tokens, the current node's row) accepts a child to descend into, or
    gives the token that ends the walk."""
    path: list[int] = []
    node = -1
    while True:
        children = tree.children(node)
        choice = choose([tree.tokens[c] for c in children], node + 1)
        if choice.accepted is None:
            return TreeVerdict(path, choice.token)
        node = children[choice.accepted]
        path.append(node)
