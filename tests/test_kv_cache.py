"""Incremental decoding through the static cache == one full forward; trim + re-decode == fresh cache."""

from __future__ import annotations

import pytest
import torch

from conftest import needs_kernels

from quasar.decoding.step import Step, run_steps
from quasar.model.kv_cache import ContextOverflowError
from helpers import default_source


def token_ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 49152, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_incremental_equals_full_forward(tiny_model):
    model, ids = tiny_model.model, token_ids(30)
    full = model(ids, model.new_cache(64))
    cache = model.new_cache(64)
    parts = [model(ids[:, :10], cache)]
    parts += [model(ids[:, i : i + 1], cache) for i in range(10, 20)]
    parts += [model(ids[:, 20:], cache)]  # a multi-token step on top of a filled cache
    assert cache.length == 30
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


@torch.no_grad()
def test_trim_then_redecode_equals_fresh_cache(tiny_model):
    model, ids, other = tiny_model.model, token_ids(24), token_ids(6, seed=1)
    cache = model.new_cache(64)
    model(ids[:, :18], cache)
    model(other, cache)  # six tokens that get rejected
    cache.trim(6)
    assert cache.length == 18
    got = model(ids[:, 18:], cache)
    fresh_cache = model.new_cache(64)
    expected = model(ids, fresh_cache)[:, 18:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.k[:, :, :, :24], fresh_cache.k[:, :, :, :24], atol=1e-6, rtol=0)


def test_cache_bounds(tiny_model):
    cache = tiny_model.model.new_cache(8)
    with pytest.raises(ContextOverflowError):
        cache.positions(9)
    cache.advance(3)
    with pytest.raises(ValueError):
        cache.trim(4)
    cache.trim(3)
    assert cache.length == 0 and cache.positions(2).tolist() == [0, 1]


@pytest.fixture(scope="module", params=["fp32", "bf16", "w8a8"])
def verifier_model(request, default_model):
    from quasar.verifiers.registry import load_verifier

    return default_model.model if request.param == "fp32" else load_verifier(default_source(), request.param).model


@torch.no_grad()
def test_a_token_scored_alone_equals_the_same_token_inside_a_verify_step(verifier_model):
    """Bitwise: the property that makes greedy speculative decoding equal plain decoding."""
    model, ids = verifier_model, token_ids(240)
    plain, verify = model.new_cache(256), model.new_cache(256)
    model(ids[:, :200], plain)
    model(ids[:, :200], verify)
    for base in range(200, 236, 6):
        alone = torch.cat([model(ids[:, i : i + 1], plain)[0] for i in range(base, base + 6)])  # [6, V]
        together = model(ids[:, base : base + 6], verify)[0]  # [6, V]
        assert torch.equal(alone, together), f"rows differ in the step at {base}"


@torch.no_grad()
def test_the_cache_records_the_tokens_it_holds(tiny_model):
    """Steps record their tokens, trim forgets them, a forward of the model alone (rows of several sequences
    in one cache, say) records none."""
    model, ids = tiny_model.model, token_ids(12)
    cache = model.new_cache(64)
    run_steps(model, [Step(ids[0, :8].tolist(), cache, last_only=True)])
    run_steps(model, [Step(ids[0, 8:10].tolist(), cache)])
    assert cache.held == ids[0, :10].tolist()
    cache.trim(3)
    assert cache.held == ids[0, :7].tolist()
    cache.reset()
    assert cache.held == [] and cache.length == 0
    batch = model.new_cache(64, batch=2)
    model(torch.cat([ids[:, :4], ids[:, 4:8]]), batch)
    assert batch.held == [] and batch.length == 4


@needs_kernels
@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_a_pool_hands_a_prompt_the_positions_a_kept_cache_shares_with_it(backend, tiny_model_dir):
    """On the kernels (every row computed alone) the longest start of a new prompt that a kept cache holds is
    reused, in that cache when its size fits or copied into a new one, and the logits of the prompt's last token
    are bitwise a fresh prefill's. On the torch path nothing is reused (a prefill and decode steps round apart)."""
    from quasar.kernels import plan
    from quasar.model.kv_cache import CachePool
    from quasar.model.loading import load
    from quasar.quant.schemes import W8A8Config, quantize_

    model = load(tiny_model_dir, "fp32").model
    if backend == "kernels":
        quantize_(model, W8A8Config(group_size=32))
        assert plan.prepare_(model).paths.startswith("kernels:")
    pool, ids = CachePool(model, spare=2), token_ids(40)[0].tolist()
    first = pool.take(64, ids[:20])
    with torch.inference_mode():
        run_steps(model, [Step(ids[:20], first, last_only=True)])
        for i in range(20, 25):  # a request's decode steps
            run_steps(model, [Step(ids[i : i + 1], first)])
    pool.give(first)
    # kept after each: ids[:30] (64); + ids[:23] + [7, 8, 9] (128); + [5] + ids[1:30] (64, the first one reset)
    cases = [(64, ids[:30], 25), (128, ids[:23] + [7, 8, 9], 23), (64, [5] + ids[1:30], 0), (64, ids[:25], 23)]
    for size, prompt, shared in cases:
        cache = pool.take(size, prompt)
        expected = shared if backend == "kernels" else 0
        assert (cache.length, cache.max_len, cache.held) == (expected, size, prompt[:expected])
        with torch.inference_mode():
            got = run_steps(model, [Step(prompt[cache.length :], cache, last_only=True)])[0][-1]
            fresh = model(torch.tensor([prompt]), model.new_cache(size), last_only=True)[0, -1]
        assert torch.equal(got, fresh)
        pool.give(cache)


def test_a_cache_takes_memory_only_for_the_positions_it_uses(tiny_model):
    """A request's cache is sized for all it may generate (the whole context when it gives no max_tokens), but
    only the positions written (and those a step reads) become resident."""
    from quasar.machine import resident_bytes

    model = tiny_model.model
    with torch.inference_mode():
        model(token_ids(50), model.new_cache(64))  # what a first forward allocates once
    before = resident_bytes()
    cache = model.new_cache(1 << 20)
    size = 2 * cache.k.numel() * cache.k.element_size()
    with torch.inference_mode():
        model(token_ids(50), cache)
    assert size > 500e6 and resident_bytes() - before < 50e6  # a few MB: what else the process allocates meanwhile
