"""Int8 layers: exact int32 backends, error bounds, zero rows, row independence (per-token scales)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quasar.quant.int8 import INT_MM, Int8Linear, Int8WeightOnlyLinear, quantize_tokens, quantize_weight


def _int8(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(-127, 128, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


@pytest.mark.parametrize("backend", ["int_mm", "blocked_float", "auto"])
@pytest.mark.parametrize("M,K,N", [(1, 64, 32), (6, 576, 192), (17, 1536, 96), (40, 2100, 64)])
def test_int32_backends_equal_reference_exactly(backend, M, K, N):
    x, w = _int8(M, K, seed=M), _int8(N, K, seed=K)
    expected = INT_MM["reference"](x, w)
    assert torch.equal(expected, (x.long() @ w.long().t()).int())
    got = INT_MM[backend](x, w)
    assert got.dtype == torch.int32 and torch.equal(got, expected)


def test_extreme_values_stay_exact():
    x = torch.full((3, 2048), 127, dtype=torch.int8)
    w = torch.full((5, 2048), -127, dtype=torch.int8)
    for backend in ("int_mm", "blocked_float"):
        assert torch.equal(INT_MM[backend](x, w), torch.full((3, 5), -127 * 127 * 2048, dtype=torch.int32))


def test_quantizers_are_symmetric_and_bounded():
    w = torch.randn(8, 32)
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale.shape == (8,)
    assert (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-6
    xq, xs = quantize_tokens(torch.randn(4, 32))
    assert xq.abs().amax(dim=1).eq(127).all() and xs.shape == (4, 1)


def _linear(K: int, N: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(K, N, bias=bias)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_int8_linear_is_close_to_float(backend):
    """Stated bound: relative L2 error below 2% for Gaussian inputs (8-bit weights and activations)."""
    linear = _linear(256, 128, bias=True)
    x = torch.randn(2, 5, 256)
    y = linear(x)
    y_q = Int8Linear.from_float(linear, backend)(x)
    assert y_q.shape == y.shape
    assert ((y_q - y).norm() / y.norm()).item() < 0.02


def test_weight_only_linear_is_closer_to_float():
    linear = _linear(256, 128, bias=True)
    x = torch.randn(7, 256)
    y = linear(x)
    err_w8a16 = ((Int8WeightOnlyLinear.from_float(linear)(x) - y).norm() / y.norm()).item()
    err_w8a8 = ((Int8Linear.from_float(linear)(x) - y).norm() / y.norm()).item()
    assert err_w8a16 < 0.01 and err_w8a16 < err_w8a8


@pytest.mark.parametrize("layer", [Int8Linear, Int8WeightOnlyLinear])
def test_all_zero_row_gives_zeros_not_nan(layer):
    linear = _linear(64, 32, bias=False)
    x = torch.randn(3, 64)
    x[1] = 0
    y = layer.from_float(linear)(x)
    assert torch.isfinite(y).all()
    assert torch.equal(y[1], torch.zeros(32))


@pytest.mark.parametrize("backend", ["int_mm", "blocked_float", "auto"])
def test_rows_do_not_depend_on_the_batch(backend):
    """Per-token scales + exact int32: [x1; x2] gives exactly the rows of x1 and x2 alone."""
    layer = Int8Linear.from_float(_linear(576, 192, bias=True), backend)
    x1, x2 = torch.randn(1, 576), 30 * torch.randn(50, 576)  # very different magnitudes
    both = layer(torch.cat([x1, x2]))
    assert torch.equal(both[:1], layer(x1))
    assert torch.equal(both[1:], layer(x2))
    assert torch.equal(both[3:9], layer(x2[2:8]))  # a verify-sized slice


def test_bf16_activations_keep_their_dtype():
    layer = Int8Linear.from_float(_linear(64, 32, bias=True))
    y = layer(torch.randn(2, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown int8 backend"):
        Int8Linear(8, 8, bias=False, backend="nope")
