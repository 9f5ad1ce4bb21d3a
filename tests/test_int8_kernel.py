"""quasar's AVX2 kernels: every int8 dot-product path is exact; W8A8 equals the reference Int8Linear bit for bit; float-activation (W8A16,
bf16) linears match float math; every row is independent of the other rows."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rows_alone
from conftest import needs_kernels

from quasar.kernels import native, plan
from quasar.kernels.quant_layers import KernelBF16Linear
from quasar.quant.bf16 import BF16Linear
from quasar.kernels.quant_layers import KernelInt8Linear
from quasar.quant.int8 import INT_MM, Int8Linear, Int8WeightOnlyLinear, quantize_tokens

pytestmark = needs_kernels


@pytest.mark.parametrize("M,K,N,bias", [(1, 576, 1536, False), (2, 576, 194, True), (6, 576, 192, True), (8, 1536, 576, False), (37, 64, 48, True), (3, 80, 40, True)])
def test_fused_kernel_is_bit_identical_to_the_reference(M, K, N, bias):
    torch.manual_seed(M)
    linear = torch.nn.Linear(K, N, bias=bias)
    reference = Int8Linear.from_float(linear, backend="reference")
    fused = plan.on_kernel(Int8Linear.from_float(linear))
    x = torch.randn(M, K) * 3
    x[0] = 0  # an all-zero row gives the bias (or zeros), not NaN
    y = fused(x)
    assert torch.equal(y, reference(x))
    assert not y.isnan().any()


PATHS = native.kernel().int8_paths() if native.kernel() is not None else []


def test_the_fastest_path_comes_first_and_every_cpu_has_maddubs():
    assert PATHS[-2:] == ["maddubs", "dpbusd-emulated"]  # dpbusd (AVX-512 VNNI) goes before them where present
    with pytest.raises(RuntimeError, match="available: auto, "):
        native.kernel().int8_mm(torch.zeros(1, 16, dtype=torch.int8), torch.zeros(1, 16, dtype=torch.int8), "vnni9")


@pytest.mark.parametrize("path", ["auto", *PATHS])
def test_int32_product_is_exact_at_the_extremes(path):
    x = torch.full((3, 4096), -127, dtype=torch.int8)
    w = torch.full((5, 4096), 127, dtype=torch.int8)
    w[1] = -127
    expected = x.long() @ w.long().t()
    assert torch.equal(native.kernel().int8_mm(x, w, path).long(), expected)


@pytest.mark.parametrize("path", ["auto", *PATHS])
@pytest.mark.parametrize("M,K", [(5, 4096), (13, 48), (1, 80), (6, 592)])
def test_int32_product_is_exact_over_the_whole_int8_range(path, M, K):
    """maddubs's pair sums |w| * x need |x| <= 127, dpbusd's offset x + 128 needs a weight-sum correction;
    -128 in x and in w, K tails past the register width and every row-block size must still come out exact."""
    torch.manual_seed(K)
    x = torch.randint(-128, 128, (M, K), dtype=torch.int8)
    w = torch.randint(-128, 128, (7, K), dtype=torch.int8)
    x[0], w[0] = -128, -128  # the extremes: every product 16384, every pair 32768
    assert torch.equal(native.kernel().int8_mm(x, w, path), INT_MM["reference"](x, w))


def test_rows_do_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    layer = plan.on_kernel(Int8Linear.from_float(torch.nn.Linear(576, 1536)))
    x = torch.randn(6, 576)
    assert_rows_alone(layer, x)
    q, _ = quantize_tokens(x)
    assert torch.equal(layer.kernel.int8_mm(q, layer.weight), INT_MM["reference"](q, layer.weight))


# ---- float activations x int8 (W8A16) or bfloat16 weights -------------------------------------------


@pytest.mark.parametrize("M,K,N,bias", [(1, 576, 1536, False), (6, 576, 192, True), (8, 1536, 576, True)])
def test_weight_only_int8_kernel_matches_float_math(M, K, N, bias):
    torch.manual_seed(M)
    layer = Int8WeightOnlyLinear.from_float(torch.nn.Linear(K, N, bias=bias))
    x = torch.randn(M, K)
    expected = (x.double() @ layer.weight.double().t()) * layer.weight_scale.double()  # [M, N]
    if bias:
        expected = expected + layer.bias.double()
    y = plan.on_kernel(layer)(x)
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5)


def test_bf16_linear_matches_float_math_and_keeps_dtype():
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 320).to(torch.bfloat16)
    layer = BF16Linear.from_linear(linear)
    assert layer.weight is not None and layer.weight.data_ptr() == linear.weight.data_ptr()  # shared, not copied
    x = torch.randn(3, 5, 576)
    expected = x.double() @ linear.weight.double().t() + linear.bias.double()  # [3, 5, N]
    y = layer(x)
    assert y.shape == (3, 5, 320) and y.dtype == torch.float32
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("weight", ["int8", "bf16"])
def test_float_activation_rows_do_not_depend_on_the_other_rows(weight):
    torch.manual_seed(1)
    linear = torch.nn.Linear(576, 1536)
    layer = Int8WeightOnlyLinear.from_float(linear) if weight == "int8" else BF16Linear.from_linear(linear)
    plan.on_kernel(layer)
    x = torch.randn(8, 576)
    assert_rows_alone(layer, x, prefixes=True)


def test_bf16_swap_is_what_the_bf16_verifier_uses(tiny_model_dir):
    from quasar.verifiers.registry import load_verifier

    model = load_verifier(tiny_model_dir, "bf16").model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, KernelBF16Linear) for m in linears)
    assert model.plan.paths.startswith("kernels:")


def test_forward_many_equals_one_call_per_layer():
    torch.manual_seed(2)
    layers = [plan.on_kernel(Int8Linear.from_float(torch.nn.Linear(576, n, bias=b)))
              for n, b in ((576, True), (192, False), (192, True))]
    x = torch.randn(1, 6, 576)
    for got, layer in zip(KernelInt8Linear.forward_many(layers, x), layers):
        assert torch.equal(got, layer(x))


def test_rms_norm_kernel_matches_torch_and_is_row_independent():
    from quasar.model.llama import RMSNorm

    torch.manual_seed(3)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576)
    x = torch.randn(1, 7, 576) * 4
    expected = norm(x)
    plan.on_kernel(norm)
    got = norm(x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(norm(x[:, 2:3]), got[:, 2:3])
