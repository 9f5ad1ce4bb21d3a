"""quasar's AVX2 W8A8 kernel equals the reference Int8Linear bit for bit, and its rows are independent."""

from __future__ import annotations

import pytest
import torch

from quasar.quant import native
from quasar.quant.int8 import INT_MM, Int8Linear, quantize_tokens

pytestmark = pytest.mark.skipif(native.kernel() is None, reason="no AVX2 kernel on this machine")


@pytest.mark.parametrize("M,K,N,bias", [(1, 576, 1536, False), (6, 576, 192, True), (8, 1536, 576, False), (37, 64, 48, True)])
def test_fused_kernel_is_bit_identical_to_the_reference(M, K, N, bias):
    torch.manual_seed(M)
    linear = torch.nn.Linear(K, N, bias=bias)
    reference = Int8Linear.from_float(linear, backend="reference")
    fused = Int8Linear.from_float(linear, backend="avx2")
    x = torch.randn(M, K) * 3
    x[0] = 0  # an all-zero row gives the bias (or zeros), not NaN
    y = fused(x)
    assert torch.equal(y, reference(x))
    assert not y.isnan().any()


def test_int32_product_is_exact_at_the_extremes():
    x = torch.full((3, 4096), -127, dtype=torch.int8)
    w = torch.full((5, 4096), 127, dtype=torch.int8)
    w[1] = -127
    expected = x.long() @ w.long().t()
    assert torch.equal(INT_MM["avx2"](x, w).long(), expected)


def test_rows_do_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    layer = Int8Linear.from_float(torch.nn.Linear(576, 1536), backend="avx2")
    x = torch.randn(6, 576)
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(6)])
    assert torch.equal(together, alone)
    q, _ = quantize_tokens(x)
    assert torch.equal(INT_MM["avx2"](q, layer.weight), INT_MM["reference"](q, layer.weight))
