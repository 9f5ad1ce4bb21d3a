"""Sliding-window attention in the kernels (Gemma 3's sliding layers): a query at position p sees keys p - window + 1
.. p and the kernel reads no key before them, on every float path and on the bf16 verifier's AMX tiles; a row gets
the same floats alone, in a verify block and in any piece of a prefill."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_kernels

from quasar.kernels import native

pytestmark = needs_kernels

START, WINDOW = 100, 24


def inputs(D: int, H: int, H_kv: int, T: int):
    torch.manual_seed(D + T)
    cache = torch.randn(2, H_kv, START + T + 8, D)
    return [torch.randn(T, H * D), torch.randn(T, H_kv * D), torch.randn(T, H_kv * D), torch.randn(T, D),
            torch.randn(T, D)], cache


def poisoned(cache: torch.Tensor, before: int) -> torch.Tensor:
    """The cache with every key and value before position `before` NaN: a kernel that reads one returns NaN."""
    cache = cache.clone()
    cache[:, :, :before] = float("nan")
    return cache


def float_paths(kernel) -> list[str]:
    return list(kernel.float_paths())


@pytest.mark.parametrize("D,H,H_kv,T,window", [(64, 4, 2, 1, 24), (64, 4, 2, 7, 24), (256, 4, 1, 5, 24),
                                               (128, 6, 3, 40, 24), (16, 4, 2, 7, 9)])
def test_a_window_sees_its_last_keys_and_reads_none_before(D, H, H_kv, T, window):
    """Each row equals, bitwise, the same query attending without a window over a cache that starts at its first
    key; keys before the step's first window are NaN and never show (a window of 9: scores padded past a row's last
    key stay inside the scratch)."""
    kernel = native.kernel()
    (q, k, v, cos, sin), cache = inputs(D, H, H_kv, T)
    scale = 0.07
    try:
        for path in float_paths(kernel):
            kernel.use_float_path(path)
            windowed = poisoned(cache, START - window + 1)
            out = kernel.decode_attention(q, k, v, cos, sin, *windowed, START, False, window, scale)
            assert torch.isfinite(out).all(), path
            for t in range(T):
                first = START + t - window + 1
                # the keys the windowed call wrote, from the row's first: its own key at position window - 1
                sliced = [c[:, first:].clone() for c in windowed]
                rows = [x[t:t + 1] for x in (q, k, v, cos, sin)]
                alone = kernel.decode_attention(*rows, *sliced, window - 1, False, 0, scale)
                assert torch.equal(out[t:t + 1], alone), (path, t)
    finally:
        kernel.use_float_path("auto")


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("D,H,H_kv", [(64, 4, 2), (256, 4, 1)])
def test_windowed_rows_are_the_same_alone_in_a_verify_block_and_in_a_prefill(D, H, H_kv, bf16):
    """70 rows over a window of 24, in pieces of every kind (rows whose windows share no key with each other's
    included): the same floats each way, on every float path; bf16: the AMX tiles where they run (keys packed from
    the window's first block, those before the first key packed as 0)."""
    kernel = native.kernel()
    if bf16 and not kernel.bf16_attention(True, D):
        pytest.skip(f"attention runs on bf16 products only on the amx float path (here: {kernel.float_path_for(True)})")
    (q, k, v, cos, sin), cache = inputs(D, H, H_kv, 70)
    cache = poisoned(cache, START - WINDOW + 1)

    def attend(t0: int, t1: int, caches) -> torch.Tensor:
        rows = [x[t0:t1].contiguous() for x in (q, k, v, cos, sin)]
        return kernel.decode_attention(*rows, caches[0], caches[1], START + t0, bf16, WINDOW)

    paths = ["amx"] if bf16 else float_paths(kernel)
    results = []
    try:
        for path in paths:
            kernel.use_float_path(path)
            whole = attend(0, 70, cache.clone())
            assert torch.isfinite(whole).all()
            for parts in ([(0, 37), (37, 70)], [(0, 1), (1, 6), (6, 70)], [(t, t + 1) for t in range(70)]):
                pieces = cache.clone()
                assert torch.equal(torch.cat([attend(a, b, pieces) for a, b in parts]), whole), (path, parts)
            results.append(whole)
    finally:
        kernel.use_float_path("auto")
    assert all(torch.equal(r, results[0]) for r in results)  # AVX2 and AVX-512: the same floats
    if bf16:  # close to the float32 attention over the same window
        float32 = kernel.decode_attention(q, k, v, cos, sin, *cache.clone(), START, False, WINDOW)
        assert not torch.equal(results[0], float32)
        assert (results[0] - float32).norm() < 0.02 * float32.norm()


def test_a_window_longer_than_the_cache_is_plain_causal_attention():
    kernel = native.kernel()
    (q, k, v, cos, sin), cache = inputs(64, 4, 2, 9)
    plain = kernel.decode_attention(q, k, v, cos, sin, *cache.clone(), START)
    assert torch.equal(kernel.decode_attention(q, k, v, cos, sin, *cache.clone(), START, False, START + 9), plain)
    with pytest.raises(RuntimeError, match="window"):
        kernel.decode_attention(q, k, v, cos, sin, *cache.clone(), START, False, -1)
