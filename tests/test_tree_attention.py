"""Draft trees on the kernels: one verify forward scores every node of a tree, each row attending to the cache and
its own ancestors only (Segment::parents, quasar.model.llama.Rows). A node's row must get bitwise the floats of the
same path verified as a chain, on every float path this CPU runs, for the attention alone and for a whole model; and
KVCache.keep must leave the cache as the chain would have.
"""

from __future__ import annotations

import pytest
import torch
from conftest import needs_kernels, tiny_hf_model, write_hf_dir

from quasar.decoding.step import run_steps
from quasar.kernels import native, plan
from quasar.model.llama import Tokens

pytestmark = needs_kernels

TREES = {  # parent row of each row (-1: the root, which follows the cache)
    "star": [-1, 0, 0, 0, 0],
    "binary": [-1, 0, 0, 1, 1, 2, 2],
    "unbalanced": [-1, 0, 1, 2, 0, 4, 1, 6, 3, 3, 0],
    "chain": [-1, 0, 1, 2],
}


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for row, parent in enumerate(parents):
        out.append(out[parent] + 1 if row else 0)
    return out


def path(parents: list[int], row: int) -> list[int]:
    """The rows from the root down to `row`."""
    rows = [row]
    while parents[rows[-1]] >= 0:
        rows.append(parents[rows[-1]])
    return rows[::-1]


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("D,H,H_kv,start,window", [(64, 4, 2, 300, 0), (128, 6, 2, 45, 0), (64, 2, 1, 70, 40)])
def test_a_tree_row_attends_as_its_path_does_as_a_chain(tree, D, H, H_kv, start, window):
    parents = TREES[tree]
    T = len(parents)
    torch.manual_seed(D + T + start)
    q, k, v = torch.randn(T, H * D), torch.randn(T, H_kv * D), torch.randn(T, H_kv * D)
    cos_table, sin_table = torch.randn(start + T, D), torch.randn(start + T, D)
    cache = torch.randn(2, H_kv, start + T + 8, D)
    at = [start + d for d in depths(parents)]
    kernel = native.kernel()
    try:
        for name in kernel.float_paths():
            kernel.use_float_path(name)
            k_tree, v_tree = cache[0].clone(), cache[1].clone()
            tree_out = kernel.decode_attention(q, k, v, cos_table[at], sin_table[at], k_tree, v_tree, start,
                                               window=window, parents=parents)  # [T, H * D]
            for row in range(T):
                rows = path(parents, row)
                k_chain, v_chain = cache[0].clone(), cache[1].clone()
                span = slice(start, start + len(rows))
                chain = kernel.decode_attention(q[rows], k[rows], v[rows], cos_table[span], sin_table[span], k_chain,
                                                v_chain, start, window=window)
                assert torch.equal(tree_out[row], chain[-1]), (name, row)
                assert torch.equal(k_tree[:, start + row], k_chain[:, start + len(rows) - 1])  # rotated at its depth
    finally:
        kernel.use_float_path("auto")


def test_a_tree_of_bad_parents_is_refused():
    kernel = native.kernel()
    q, k, v = torch.randn(3, 64), torch.randn(3, 64), torch.randn(3, 64)
    cos, sin, cache = torch.randn(3, 64), torch.randn(3, 64), torch.randn(2, 1, 16, 64)
    for parents in ([-1, 0, 2], [0, 0, 1], [-1, -1, 0], [-1, 0]):
        with pytest.raises(RuntimeError, match="parent|one per row"):
            kernel.decode_attention(q, k, v, cos, sin, cache[0], cache[1], 4, parents=parents)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def fused_model(request, tmp_path_factory, tokenizer_dir):
    from quasar.model.loading import load
    from quasar.quant.schemes import W8A8Config, quantize_

    directory = write_hf_dir(tiny_hf_model(request.param, seed=5), tmp_path_factory.mktemp(request.param), tokenizer_dir)
    model = load(directory, "fp32").model
    quantize_(model, W8A8Config(group_size=32))
    assert plan.prepare_(model).tree_rows
    return model


def test_a_tree_verify_step_scores_each_node_as_its_chain(fused_model):
    """Every node's logits equal the last row of its path verified as a chain; keeping one path leaves the cache
    holding what the chain wrote, so the next step's logits are the chain's too."""
    model = fused_model
    parents = TREES["unbalanced"]
    torch.manual_seed(1)
    prompt, tokens = torch.randint(0, 1000, (40,)).tolist(), torch.randint(0, 1000, (len(parents),)).tolist()
    with torch.inference_mode():
        cache = model.new_cache(96)
        run_steps(model, [Tokens(prompt, cache, last_only=True)])
        tree = run_steps(model, [Tokens(tokens, cache, tree=tuple(parents))])[0]  # [T, V]
        for row in range(len(parents)):
            rows = path(parents, row)
            chain_cache = model.new_cache(96)
            model.forward_steps([Tokens(prompt, chain_cache, last_only=True)])
            chain = model.forward_steps([Tokens([tokens[r] for r in rows], chain_cache)])[0]
            assert torch.equal(tree[row], chain[-1]), row
        kept = path(parents, 7)  # rows 0, 1, 6, 7
        cache.keep(len(prompt), [len(prompt) + r for r in kept])
        assert cache.length == len(prompt) + len(kept) and cache.held[len(prompt):] == [tokens[r] for r in kept]
        after_tree = model.forward_steps([Tokens([11, 12], cache)])[0]
        chain_cache = model.new_cache(96)
        model.forward_steps([Tokens(prompt + [tokens[r] for r in kept], chain_cache, last_only=True)])
        after_chain = model.forward_steps([Tokens([11, 12], chain_cache)])[0]
    assert torch.equal(after_tree, after_chain)


def test_a_tree_in_a_batch_is_scored_as_alone(fused_model):
    model = fused_model
    parents = TREES["binary"]
    torch.manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,)).tolist() for n in (30, 17)]
    tokens = torch.randint(0, 1000, (len(parents),)).tolist()
    with torch.inference_mode():
        caches = [model.new_cache(64) for _ in prompts]
        model.forward_steps([Tokens(p, c, last_only=True) for p, c in zip(prompts, caches)])
        together = model.forward_steps([Tokens(tokens, caches[0], tree=tuple(parents)), Tokens([5, 6, 7], caches[1])])
        alone_cache = model.new_cache(64)
        model.forward_steps([Tokens(prompts[0], alone_cache, last_only=True)])
        alone = model.forward_steps([Tokens(tokens, alone_cache, tree=tuple(parents))])[0]
    assert torch.equal(together[0], alone)


def test_a_tree_needs_the_fused_kernels(tmp_path, tokenizer_dir):
    from quasar.model.loading import load

    model = load(write_hf_dir(tiny_hf_model("llama", seed=1), tmp_path, tokenizer_dir), "fp32").model
    cache = model.new_cache(32)
    with pytest.raises(ValueError, match="draft trees need"):
        model.forward_steps([Tokens([1, 2, 3], cache, tree=(-1, 0, 0))])
