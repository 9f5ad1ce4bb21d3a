"""Speculative decoding with draft trees (quasar.decoding.tree, tree_budget): several candidates a position, one
verify forward, the output's distribution the verifier's (statistical, on a tiny model on the fused kernels), greedy
output plain decoding's token for token, the cache as plain decoding leaves it, and budgets that follow row costs."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_kernels
from test_speculative import PROMPT, one_thread, run, small_model  # noqa: F401 (a fixture)
from test_verify import chi_square_p

from quasar.decoding.autoregressive import autoregressive
from quasar.decoding.costs import StepCosts
from quasar.decoding.drafters.model_drafter import ModelDrafter, tree_shape
from quasar.decoding.drafters.ngram import NgramDrafter
from quasar.decoding.drafters.suffix import SuffixDrafter
from quasar.decoding.sampling import SamplingParams, logits_to_probs
from quasar.decoding.speculative import Speculative
from quasar.decoding.tree import DraftTree, TreeVerdict
from quasar.decoding.tree_budget import TreeBudget
from quasar.kernels import plan
from quasar.model.llama import Transformer
from quasar.spec import AUTO, parse_tree

pytestmark = needs_kernels

V = 16  # the kernels' linears take outputs in 16s; small enough to enumerate three tokens' joint distribution
BRANCHING = [t for a in range(V) for t in (a, (a + 1) % V, a, (a + 5) % V, a, (a + 9) % V)]  # 3 followers a token


def fused_model(seed: int, sharpness: float = 4.0) -> Transformer:
    """test_speculative's small model over V tokens, on the fused kernels."""
    model = small_model(seed, sharpness, vocab=V)
    assert plan.prepare_(model).tree_rows
    return model


@torch.inference_mode()
def exact_joint(model: Transformer, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] under the model with `params`, each sequence scored alone."""
    def row(tokens: list[int]) -> torch.Tensor:
        return logits_to_probs(model(torch.tensor([tokens]), model.new_cache(128))[0, -1], params)  # [V]

    first = row(prompt)
    second = torch.stack([row([*prompt, a]) for a in range(V)])  # [V, V]
    third = torch.stack([row([*prompt, a, b]) for a in range(V) for b in range(V)]).view(V, V, V)
    return first[:, None, None] * second[:, :, None] * third


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tree_sampling_is_lossless(temperature, one_thread):
    """The first three tokens emitted with width-3 trees (two of them through the tree walk) follow the verifier's
    joint distribution."""
    model, n = fused_model(seed=0), 800
    decoder = Speculative(NgramDrafter(1, 1), k=2, width=3)
    counts, wide = torch.zeros(V, V, V), 0
    for seed in range(n):
        params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=3, ignore_eos=True)
        tokens, _, stats = run(model, decoder, BRANCHING, params, budget=4, cache_len=128)
        counts[tuple(tokens[:3])] += 1
        wide += stats.proposed_tokens > 2 * stats.verify_steps  # more nodes than a chain of k
    joint = exact_joint(model, BRANCHING, SamplingParams(temperature=temperature))
    assert wide > n // 2  # trees were really proposed and verified
    assert chi_square_p(counts.flatten(), joint.flatten()) > 1e-3
    assert chi_square_p(counts.sum((0, 1)), joint.sum((0, 1))) > 1e-3


def test_model_drafter_tree_sampling_is_lossless(one_thread):
    """A draft model's trees (its greedy chain and its next likeliest tokens beside each) keep the verifier's
    distribution."""
    model, draft, n = fused_model(seed=0), fused_model(seed=1, sharpness=3.0), 800
    decoder = Speculative(ModelDrafter(draft, V), k=2, width=3)
    counts, wide = torch.zeros(V, V, V), 0
    for seed in range(n):
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=3, ignore_eos=True)
        tokens, _, stats = run(model, decoder, PROMPT, params, budget=4)
        counts[tuple(tokens[:3])] += 1
        wide += stats.proposed_tokens > 2 * stats.verify_steps
    joint = exact_joint(model, PROMPT, SamplingParams(temperature=1.0))
    assert wide > n // 2
    assert chi_square_p(counts.flatten(), joint.flatten()) > 1e-3
    assert chi_square_p(counts.sum((0, 1)), joint.sum((0, 1))) > 1e-3


def test_a_model_drafters_tree_is_its_greedy_chain_with_siblings():
    draft = fused_model(seed=1)
    drafter = ModelDrafter(draft, V)
    drafter.commit(PROMPT)
    chain = drafter.propose(4, SamplingParams(), torch.Generator()).tokens
    tree = drafter.propose_tree(12, 3, lambda depth, rank: (0.9, 0.5, 0.2)[rank] if depth <= 4 else 0.0)
    assert [tree.tokens[node] for node in tree.path(max(range(len(tree)), key=lambda i: tree.depths()[i]))] == chain
    assert all(len(tree.children(node)) <= 3 for node in range(-1, len(tree)))
    assert tree.chances == sorted(tree.chances, reverse=True)
    narrow = drafter.propose_tree(4, 1, lambda depth, rank: 0.5)  # width 1: the chain
    assert (narrow.tokens, narrow.parents) == (chain, [-1, 0, 1, 2])
    shape = tree_shape(6, 2, lambda depth, rank: (0.8, 0.3)[rank])  # a sibling of 0.3 beats the chain past 0.8^5
    assert [(d, r) for d, r, _ in shape] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (1, 1)]


@pytest.mark.parametrize("width", [2, 4, AUTO])
@pytest.mark.parametrize("drafter", ["ngram", "suffix", "model"])
def test_greedy_tree_output_is_plain(width, drafter, one_thread):
    model = fused_model(seed=0)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    make = {"ngram": lambda: NgramDrafter(1, 3), "suffix": lambda: SuffixDrafter(1, 3),
            "model": lambda: ModelDrafter(fused_model(seed=1, sharpness=3.0), V)}[drafter]
    decoder = Speculative(make(), k=AUTO if width == AUTO else 4, width=width)
    tokens, cache, stats = run(model, decoder, BRANCHING, params, budget=40, cache_len=160)
    plain, plain_cache, _ = run(model, autoregressive, BRANCHING, params, budget=40, cache_len=160)
    assert tokens == plain
    assert stats.proposed_tokens > (0 if width == AUTO else stats.verify_steps)  # trees, not single tokens
    n = cache.length
    assert n == plain_cache.length and cache.held == plain_cache.held
    assert torch.equal(cache.k[:, :, :, :n], plain_cache.k[:, :, :, :n])


@pytest.mark.parametrize("b", [0.01, 20.0])
@pytest.mark.parametrize("drafter,width", [("ngram", 1), ("ngram", AUTO), ("suffix", 1), ("suffix", AUTO),
                                           ("model", AUTO)])
def test_a_seeded_sampled_request_gives_plain_decodings_tokens_whatever_it_drafts(drafter, width, b, one_thread):
    """A copying drafter's chains and every drafter's trees (a model drafter's: its greedy chain and next likeliest
    tokens) are matched against plain decoding's draws: with the same seed the output is plain decoding's token for
    token, whether rows are nearly free (long drafts) or dear (none)."""
    model = fused_model(seed=2)
    make = {"ngram": lambda: NgramDrafter(1, 3), "suffix": lambda: SuffixDrafter(1, 3),
            "model": lambda: ModelDrafter(fused_model(seed=1, sharpness=3.0), V)}[drafter]
    for params in (SamplingParams(temperature=1.0, seed=7, max_new_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.7, top_k=6, seed=8, max_new_tokens=40, ignore_eos=True)):
        decoder = Speculative(make(), k=AUTO, width=width)
        decoder.costs = costs(1.0, b)  # a seeded request's drafts follow measured costs
        tokens, cache, stats = run(model, decoder, BRANCHING, params, budget=40, cache_len=160)
        plain, plain_cache, _ = run(model, autoregressive, BRANCHING, params, budget=40, cache_len=160)
        assert tokens == plain
        assert cache.length == plain_cache.length and cache.held == plain_cache.held
        drafted = stats.proposed_tokens / stats.verify_steps  # a model drafter drafts one node at least
        assert drafted < (1.5 if drafter == "model" else 0.5) if b == 20.0 else drafted > 1


def costs(a: float, b: float) -> StepCosts:
    out = StepCosts()
    for rows in (1, 2, 4, 8, 16):
        for _ in range(3):
            out.add(rows, a + b * rows)
    return out


@pytest.mark.parametrize("b", [0.01, 20.0])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tree_request_drafts_what_rows_pay_for(b, temperature, one_thread):
    """Where a row costs 20 plain steps, a free drafter's trees shrink to nothing (plain steps, whose rows keep
    telling the budget how its candidates fare), at any temperature; where rows are nearly free, trees grow."""
    model = fused_model(seed=0)
    params = SamplingParams(temperature=temperature, max_new_tokens=40, ignore_eos=True)
    decoder = Speculative(NgramDrafter(1, 1), k=AUTO, width=AUTO)
    decoder.costs = costs(1.0, b)
    _, _, stats = run(model, decoder, BRANCHING, params, budget=40, cache_len=160)
    drafted = stats.proposed_tokens / stats.verify_steps  # nodes a step
    assert drafted < 0.5 if b == 20.0 else drafted > 2


def test_the_budget_keeps_the_nodes_that_pay():
    tree = DraftTree([5, 6, 7, 8, 9], [-1, 0, -1, 0, 1], [0.9, 0.5, 0.3, 0.2, 0.1])  # best first
    assert len(TreeBudget(AUTO, AUTO, costs(1.0, 20.0)).cut(tree)) == 5  # a new budget reaches the third depth
    budgets = [TreeBudget(AUTO, AUTO, costs(1.0, b), k_min=0) for b in (0.01, 2.0, 20.0)]
    for budget in budgets:
        budget.count(tree, TreeVerdict([], 5))  # nothing accepted: no depth to reach
    assert [len(budget.cut(tree)) for budget in budgets] == [5, 1, 0]  # rows nearly free; 2/3 of a step; 20 steps
    budgets[2].count(tree, TreeVerdict([0, 1, 4], 3))  # a whole branch, three deep
    assert len(budgets[2].cut(tree)) == 5  # its next tree goes as deep, whatever rows cost
    assert len(TreeBudget(3, 4, costs(1.0, 20.0)).cut(tree)) == 5  # fixed k: the drafter's whole tree


def test_the_budget_asks_for_no_more_nodes_than_it_could_keep():
    budgets = {b: TreeBudget(AUTO, AUTO, costs(1.0, b)) for b in (0.01, 20.0)}
    for budget in budgets.values():
        budget.count(DraftTree([5], [-1]), TreeVerdict([], 6))  # nothing accepted: no depth to reach
    assert budgets[0.01].nodes(64) == 15 and budgets[0.01].nodes(4) == 3  # the most, within the room
    assert budgets[20.0].nodes(64) == 4  # dear rows: only enough for the first position's candidates
    assert TreeBudget(AUTO, AUTO, costs(1.0, 20.0)).nodes(64) >= 4  # a new budget: enough to reach 4 deep
    assert TreeBudget(2, 5, costs(1.0, 20.0)).nodes(64) == 15  # fixed k: as many as fit


def test_the_budget_learns_each_ranks_acceptance():
    budget = TreeBudget(3, AUTO, None)
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 0, 0])
    before = budget.chance(1, 1), budget.chance(1, 0), budget.chance(2, 0)
    for _ in range(10):
        budget.count(tree, TreeVerdict([1], 3))  # the second candidate, every time
    assert budget.chance(1, 1) > before[0] and budget.chance(1, 0) < before[1]
    assert budget.chance(2, 0) == before[2]  # node 1 has no children: depth 2 was never tried
    assert budget.chance(1, 3) == 0.0 and budget.chance(8, 0) == 0.0  # wider or deeper than allowed


def test_a_bad_tree_width_is_refused():
    assert parse_tree("auto") == AUTO and parse_tree("3") == 3
    for bad in ("0", "5", "-1", "wide"):
        with pytest.raises(ValueError, match="--tree"):
            parse_tree(bad)
