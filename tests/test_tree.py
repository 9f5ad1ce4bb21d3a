"""Draft trees: the node table and its verify rows, the walk that verifies a tree (greedy: the argmax walk, a chain's
greedy_verdict; sampled: every emitted token follows its target row given the ones before it), and the trees the
n-gram and suffix drafters grow (width 1: their greedy draft as a chain)."""

from __future__ import annotations

import random

import pytest
import torch

from quasar.decoding.drafters.ngram import NgramDrafter
from quasar.decoding.drafters.suffix import SuffixDrafter
from quasar.decoding.rejection import greedy_verdict
from quasar.decoding.sampling import Sampler, SamplingParams, logits_to_probs
from quasar.decoding.tree import MAX_TREE, DraftTree, TreeVerdict, greedy_tree_verdict, sample_tree_verdict
from quasar.spec import MAX_DRAFT
from test_verify import chi_square_p, one_hot, rows

pytestmark = pytest.mark.usefixtures("sampling_path")  # every test on torch and on the kernel

V = 10  # the toy vocabulary


def test_rows_depths_paths_and_prefixes():
    tree = DraftTree([5, 6, 7, 8, 9], [-1, -1, 0, 0, 3])  # 5 -> (7, 8 -> 9), 6
    assert tree.rows() == (-1, 0, 0, 1, 1, 4)
    assert tree.rows(feed=2) == (-1, 0, 1, 1, 2, 2, 5)  # the feed rows a chain, the root's children after the last
    assert tree.depths() == [1, 1, 2, 2, 3]
    assert (tree.children(-1), tree.children(0), tree.children(4)) == ([0, 1], [2, 3], [])
    assert (tree.path(4), tree.path(1)) == ([0, 3, 4], [1])
    assert tree.prefix(3) == DraftTree([5, 6, 7], [-1, -1, 0])
    assert len(tree) == 5 and not tree.is_chain()
    chain = DraftTree.chain([4, 4, 2])
    assert chain == DraftTree([4, 4, 2], [-1, 0, 1]) and chain.is_chain() and chain.prefix(0).is_chain()
    assert chain.rows() == (-1, 0, 1, 2) and chain.rows(feed=3) == (-1, 0, 1, 2, 3, 4)
    assert DraftTree([], []).rows(feed=2) == (-1, 0)
    with_chances = DraftTree([1, 2], [-1, 0], [0.9, 0.5])
    assert with_chances.prefix(1).chances == [0.9]


@pytest.mark.parametrize("tokens, parents, chances, message", [
    ([1, 2], [-1], [], "one parent per token"),
    ([1, 2], [-1, 1], [], "node 1's parent must be a node before it"),
    ([1], [-2], [], "node 0's parent must be"),
    ([1, 2, 1], [-1, 0, -1], [], "siblings must be distinct tokens: node 2 repeats token 1"),
    ([1, 2], [-1, 0], [0.5], "chances must be empty or one per token"),
])
def test_bad_trees_are_refused(tokens, parents, chances, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(tokens, parents, chances)


def random_tree(g: random.Random, n: int) -> DraftTree:
    """n nodes, each under a random earlier node (or the root), with distinct sibling tokens from [0, V)."""
    tokens: list[int] = []
    parents: list[int] = []
    for i in range(n):
        parent = g.randrange(-1, i)
        taken = {t for t, p in zip(tokens, parents) if p == parent}
        parents.append(parent)
        tokens.append(g.choice([t for t in range(V) if t not in taken]))
    return DraftTree(tokens, parents)


def test_greedy_walk_follows_the_argmax():
    """Each accepted node is a child of the one before it carrying its row's argmax; the walk stops at a node none
    of whose children carries its argmax, with that argmax; sampling one-hot rows gives the same verdict."""
    g = random.Random(0)
    lengths = set()
    for _ in range(300):
        tree = random_tree(g, g.randrange(0, 9))
        argmax = [g.randrange(V) for _ in range(len(tree) + 1)]  # [n + 1]
        for node, token in enumerate(tree.tokens):  # acceptance made likely: a child often carries the argmax
            if g.random() < 0.6:
                argmax[tree.parents[node] + 1] = token
        verdict = greedy_tree_verdict(tree, argmax)
        at = -1
        for node in verdict.path:
            assert tree.parents[node] == at and tree.tokens[node] == argmax[at + 1]
            at = node
        assert verdict.token == argmax[at + 1]
        assert verdict.token not in [tree.tokens[c] for c in tree.children(at)]
        assert sample_tree_verdict(tree, rows(one_hot(argmax, V)), torch.Generator().manual_seed(1)) == verdict
        lengths.add(verdict.accepted)
    assert {0, 1, 2} <= lengths


def test_greedy_walk_of_a_chain_is_greedy_verdict():
    g = random.Random(1)
    for _ in range(300):
        k = g.randrange(0, MAX_DRAFT + 1)
        argmax = [g.randrange(4) for _ in range(k + 1)]  # [k + 1]
        draft = [a if g.random() < 0.7 else g.randrange(4) for a in argmax[:k]]
        verdict = greedy_tree_verdict(DraftTree.chain(draft), argmax)
        expected = greedy_verdict(draft, argmax)
        assert (verdict.accepted, verdict.token) == (expected.accepted, expected.token)
        assert verdict.path == list(range(expected.accepted))


SHAPES = {  # parents per node, and which of the parent row's tokens (by rank, 0 the most likely) each node carries
    "chain": ([-1, 0, 1], [1, 0, 0]),
    "star": ([-1, -1, -1], [1, 0, V - 1]),  # the second likeliest token, the likeliest, the least likely (0 at T=0.7 top_k=6)
    "2x2": ([-1, -1, 0, 0, 1, 1], [0, 1, 1, 4, 0, V - 1]),
    "unbalanced": ([-1, -1, 0, 2, 0], [0, 3, 2, 0, 5]),
}
TARGETS = {"T=1": SamplingParams(temperature=1.0), "T=0.7 top_k=6": SamplingParams(temperature=0.7, top_k=6)}
DRAWS = 4000


def shaped(shape: str, params: SamplingParams, seed: int) -> tuple[DraftTree, torch.Tensor, torch.Tensor]:
    """A tree of this shape with its nodes' tokens picked by rank in their parent's row, the logits of its
    rows [n + 1, V] and their probabilities [n + 1, V]."""
    parents, ranks = SHAPES[shape]
    logits = torch.randn(len(parents) + 1, V, generator=torch.Generator().manual_seed(seed)) * 1.5  # [n + 1, V]
    probs = logits_to_probs(logits, params)  # [n + 1, V]
    order = logits.argsort(-1, descending=True).tolist()  # [n + 1, V]
    return DraftTree([order[p + 1][r] for p, r in zip(parents, ranks)], parents), logits, probs


def emitted(tree: DraftTree, verdict: TreeVerdict) -> list[int]:
    """The tokens a step emits: the accepted path's, then the recovered or bonus token."""
    return [tree.tokens[node] for node in verdict.path] + [verdict.token]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_emitted_tokens_follow_the_target(shape, target):
    """The first emitted token follows the root's row, and the token after node x follows x's row given that x was
    emitted: the output follows the target autoregressively whatever tree was drafted."""
    params = TARGETS[target]
    tree, logits, probs = shaped(shape, params, seed=len(shape))
    rows_, g = Sampler(params).rows(logits), torch.Generator().manual_seed(2)
    first = torch.zeros(V)
    after = {node: torch.zeros(V) for node in range(len(tree))}  # the token emitted after node x, given x was
    for _ in range(DRAWS):
        verdict = sample_tree_verdict(tree, rows_, g)
        tokens = emitted(tree, verdict)
        first[tokens[0]] += 1
        for node, token in zip(verdict.path, tokens[1:]):
            after[node][token] += 1
    checked = [(first, probs[0])] + [(after[x], probs[x + 1]) for x in after if after[x].sum() >= 150]
    assert len(checked) >= 3
    for counts, row_probs in checked:
        assert (counts[row_probs == 0] == 0).all()
        assert chi_square_p(counts, row_probs) > 1e-3


def test_a_seeded_walk_repeats_draw_for_draw():
    params = TARGETS["T=1"]
    tree, logits, _ = shaped("2x2", params, seed=3)
    runs = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        rows_, g = Sampler(params).rows(logits), torch.Generator().manual_seed(4)
        runs.append([sample_tree_verdict(tree, rows_, g) for _ in range(300)])
    assert runs[0] == runs[1]
    assert len({tuple(v.path) for v in runs[0]}) >= 4


GREEDY, GEN = SamplingParams(), torch.Generator()


def constant(depth: int, rank: int) -> float:
    return 0.5


def falling(depth: int, rank: int) -> float:
    return 0.95 / (1 + rank) ** 2


def streams() -> list[list[int]]:
    """Token streams with long and short matches, copies that run into the end of the text, no match at all."""
    g = random.Random(5)
    made = [[7, 1, 2, 3, 9, 9, 5, 2, 3, 8, 8, 1, 2, 3], [1, 2, 1, 2, 1], [4, 5, 6], [3, 3, 3, 3, 3, 3]]
    made += [[g.randrange(4) for _ in range(g.randrange(5, 60))] for _ in range(30)]
    return made + [[g.randrange(12) for _ in range(40)] for _ in range(10)]


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_width_one_is_the_greedy_draft(drafter):
    """propose_tree(k, 1, chance) is DraftTree.chain of propose's greedy draft of k tokens, for any positive chance."""
    make = (lambda: NgramDrafter(1, 3)) if drafter == "ngram" else (lambda: SuffixDrafter(1, 8))
    chances = (constant, lambda depth, rank: 0.9**depth / (1 + rank), lambda depth, rank: 1.0)
    copies = 0
    for i, stream in enumerate(streams()):
        d = make()
        if drafter == "suffix" and i % 2:  # an earlier request's text to copy from
            d.commit(streams()[i - 1])
            d.reset()
        d.commit(stream)
        for k in range(MAX_DRAFT + 1):
            chain = DraftTree.chain(d.propose(k, GREEDY, GEN).tokens)
            for chance in chances:
                tree = d.propose_tree(k, 1, chance)
                assert DraftTree(tree.tokens, tree.parents) == chain, (stream, k)
        copies += len(chain) > 0
    assert copies > 20


def counted() -> NgramDrafter:
    """(5, 1) was followed by 9 once (its earliest occurrence), 7 three times, 8 once and 6 twice."""
    d = NgramDrafter(1, 2)
    d.commit([5, 1, 9, 4, 5, 1, 7, 5, 1, 6, 5, 1, 7, 5, 1, 8, 2, 5, 1, 7, 5, 1, 6, 3, 5, 1])
    return d


def test_siblings_are_the_copy_then_the_other_continuations_by_count():
    d = counted()
    for width, expected in ((2, [9, 7]), (3, [9, 7, 6]), (4, [9, 7, 6, 8]), (6, [9, 7, 6, 8])):
        tree = d.propose_tree(MAX_TREE, width, lambda depth, rank: 0.9 if depth == 1 else 0.01)
        assert [tree.tokens[c] for c in tree.children(-1)] == expected  # all the root's children join first
        assert tree.parents[: len(expected)] == [-1] * len(expected)
    tree = d.propose_tree(3, 2, lambda depth, rank: 0.9 if rank == 0 else 0.2)
    assert tree == DraftTree([9, 4, 5], [-1, 0, 1], [0.9, 0.9**2, 0.9**3])  # the copy 9, 4, 5 beats 7's 0.2
    tree = d.propose_tree(4, 3, lambda depth, rank: (0.8, 0.7, 0.1)[rank])  # best-first across branches:
    assert tree == DraftTree([9, 7, 4, 5], [-1, -1, 0, 1], [0.8, 0.7, 0.8**2, 0.7 * 0.8])  # 7's copy goes on with 5


def test_suffix_siblings_copy_the_most_recent_occurrence_first():
    d = SuffixDrafter(1, 2)
    d.commit([5, 1, 9, 4, 5, 1, 7, 5, 1, 6, 3])
    d.reset()
    d.commit([8, 5, 1])
    tree = d.propose_tree(6, 3, lambda depth, rank: 0.9 if depth == 1 else 0.01)
    assert [tree.tokens[c] for c in tree.children(-1)] == [6, 7, 9]  # the most recent copy, then by count, by id
    deep = d.propose_tree(6, 3, lambda depth, rank: 0.9 if rank == 0 else 0.01)
    assert deep.tokens[:2] == [6, 3]  # copying the end of the earlier request, where the copy stops
    assert deep.tokens[2] == 7


@pytest.mark.parametrize("width", [1, 2, 3])
def test_trees_keep_their_limits_and_estimates(width):
    """At most `nodes` nodes and `width` children a node, MAX_DRAFT deep; siblings in rank order; each chance is its
    parent's times chance(depth, rank), so chances never grow along a path (nor along the order nodes joined in);
    a chance of 0 is no candidate."""
    chance = falling
    for stream in streams()[4:]:
        d = NgramDrafter(1, 3)
        d.commit(stream)
        for nodes in (0, 1, 5, MAX_TREE):
            tree = d.propose_tree(nodes, width, chance)
            assert len(tree) <= nodes and max(tree.depths(), default=0) <= MAX_DRAFT
            for node in range(-1, len(tree)):
                assert len(tree.children(node)) <= width
            for node, (parent, depth) in enumerate(zip(tree.parents, tree.depths())):
                rank = tree.children(parent).index(node)
                above = tree.chances[parent] if parent >= 0 else 1.0
                assert tree.chances[node] == pytest.approx(above * chance(depth, rank))
            assert tree.chances == sorted(tree.chances, reverse=True)
            # best-first: a smaller tree is a larger one's first nodes (and growing one moved nothing in the drafter)
            assert tree == d.propose_tree(MAX_TREE, width, chance).prefix(nodes)
    deep = NgramDrafter(1, 3)
    deep.commit([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2])
    assert deep.propose_tree(MAX_TREE, width, lambda depth, rank: 1.0 if rank == 0 else 0.0).depths() == [
        1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="0 to 15 nodes"):
        deep.propose_tree(MAX_TREE + 1, width, chance)
