"""Incremental decoding through the static cache == one full forward; trim + re-decode == fresh cache."""

from __future__ import annotations

import pytest
import torch

from quasar.kv_cache import ContextOverflowError


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
    from quasar.verifiers import load_verifier

    return default_model.model if request.param == "fp32" else load_verifier("default", request.param).model


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
