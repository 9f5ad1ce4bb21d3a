"""Group-wise W8A8 on quasar's kernels: every int8 path gives the exact sum of its groups' int32 products
times their scales; the whole linear matches the torch reference; rows never depend on the other rows."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_rows_alone
from conftest import needs_kernels

from quasar.kernels import native, plan
from quasar.kernels.quant_layers import KernelInt8Linear, pack_int8_panels
from quasar.quant.int8 import Int8Linear, dequantize, quantize_groups

pytestmark = needs_kernels
PATHS = native.kernel().int8_paths() if native.kernel() is not None else []


def reference(q, x_scale, w, w_scale) -> torch.Tensor:
    """float64: sum_g x_scale[:, g] * w_scale[:, g] * (q_g . w_g)."""
    M = q.shape[0]
    groups = x_scale.shape[1]
    dots = torch.einsum("mgk,ngk->mng", q.double().view(M, groups, -1), w.double().view(w.shape[0], groups, -1))
    return (dots * x_scale.double()[:, None, :] * w_scale.double()[None, :, :]).sum(-1)  # [M, N]


@pytest.mark.parametrize("path", ["auto", *PATHS])
@pytest.mark.parametrize("G,K", [(32, 576), (64, 576), (96, 288), (128, 1536), (64, 64)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17])
def test_group_product_is_exact_over_the_whole_int8_range(path, G, K, M):
    """Power-of-two scales keep every partial sum exact in float32 (K * 127 * 128 < 2^24), so the kernel must
    equal the float64 reference bit for bit: any wrong int32 group sum, lane, tail chunk (G = 96 on 64-byte
    registers) or row block (1-8 and more) shows. maddubs takes |q| <= 127 (the quantizer never makes -128)."""
    gen = torch.Generator().manual_seed(G * 1000 + K + M)
    low = -127 if path == "maddubs" or (path == "auto" and PATHS[0] == "maddubs") else -128
    q = torch.randint(low, 128, (M, K), generator=gen, dtype=torch.int8)
    w = torch.randint(-128, 128, (13, K), generator=gen, dtype=torch.int8)
    q[0], w[0] = low, -128  # the extremes
    x_scale = 2.0 ** -torch.randint(0, 3, (M, K // G), generator=gen).float()
    w_scale = 2.0 ** -torch.randint(0, 3, (13, K // G), generator=gen).float()
    y = native.kernel().int8_group_mm(q, x_scale, w, w_scale, path)
    assert torch.equal(y.double(), reference(q, x_scale, w, w_scale))
    for m in range(M):  # each row alone gives the same bits (its scales are its own rows too)
        assert torch.equal(native.kernel().int8_group_mm(q[m : m + 1], x_scale[m : m + 1], w, w_scale, path)[0], y[m])


def test_group_product_refuses_what_it_cannot_do():
    kernel = native.kernel()
    q, w = torch.zeros(1, 96, dtype=torch.int8), torch.zeros(4, 96, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="multiple of 32 dividing K"):
        kernel.int8_group_mm(q, torch.ones(1, 2), w, torch.ones(4, 2), "auto")  # G = 48
    with pytest.raises(RuntimeError, match=r"\[-127, 127\]"):
        kernel.int8_group_mm(torch.full((1, 96), -128, dtype=torch.int8), torch.ones(1, 3), w, torch.ones(4, 3), "maddubs")


@pytest.mark.parametrize("G", [32, 64])
@pytest.mark.parametrize("M,K,N,bias", [(1, 576, 1536, False), (6, 576, 194, True), (8, 1536, 576, False), (11, 64, 48, True)])
def test_grouped_linear_matches_the_torch_reference(G, M, K, N, bias):
    """The fused kernel (quantization, group products, rescale, bias in one call) against the torch path of
    the same layer: the same int8 activations and scales, sums that differ only in float rounding order."""
    torch.manual_seed(M + G)
    linear = torch.nn.Linear(K, N, bias=bias)
    fused = plan.on_kernel(Int8Linear.from_float(linear, group_size=G))
    reference_layer = Int8Linear.from_float(linear, backend="reference", group_size=G)
    assert fused.weight_scale.shape == (N, K // G)
    x = torch.randn(M, K) * 3
    x[0, :G] = 0  # an all-zero group: scale 1, contributes nothing, no NaN
    y = fused(x)
    assert not y.isnan().any()
    assert torch.allclose(y, reference_layer(x), rtol=1e-5, atol=1e-4)
    q, x_scale = quantize_groups(x, G)
    expected = reference(q, x_scale, fused.weight, fused.weight_scale) + (linear.bias.double() if bias else 0)
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-4)


def test_grouped_rows_do_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    layer = plan.on_kernel(Int8Linear.from_float(torch.nn.Linear(576, 1536), group_size=64))
    x = torch.randn(8, 576)
    assert_rows_alone(layer, x, prefixes=True)


def test_grouped_forward_many_equals_one_call_per_layer():
    torch.manual_seed(2)
    layers = [plan.on_kernel(Int8Linear.from_float(torch.nn.Linear(576, n, bias=b), group_size=64))
              for n, b in ((576, True), (192, False))]
    x = torch.randn(1, 6, 576)
    for got, layer in zip(KernelInt8Linear.forward_many(layers, x), layers):
        assert torch.equal(got, layer(x))


def test_kernel_quantization_matches_quantize_groups():
    """The kernel's per-group activation quantization is quantize_groups bit for bit: with unit weights at
    one input, the output of channel n is exactly x_int8[:, n] * x_scale of its group."""
    torch.manual_seed(4)
    K, G = 128, 32
    layer = Int8Linear(K, K, bias=False, group_size=G)
    layer.weight = torch.eye(K, dtype=torch.int8)
    layer.weight_scale = torch.ones(K, K // G)
    plan.on_kernel(layer)
    x = torch.randn(5, K) * 7
    q, x_scale = quantize_groups(x, G)
    assert torch.equal(layer(x), q.float() * x_scale.repeat_interleave(G, dim=1))


def test_a_group_size_that_does_not_divide_k_is_refused():
    with pytest.raises(ValueError, match="group size 64 does not divide the 96 inputs"):
        Int8Linear(96, 8, bias=False, group_size=64)
    with pytest.raises(ValueError, match="multiple of 32"):
        Int8Linear(96, 8, bias=False, group_size=48)


@pytest.mark.parametrize("G", [32, 64, 96])
@pytest.mark.parametrize("N", [48, 40])  # 48: packed 16-channel panels (dpbusd and maddubs); 40: not packable
@pytest.mark.parametrize("M", [1, 3, 6, 8, 11])
def test_grouped_linear_is_exact_with_dyadic_scales(G, N, M, K=192):
    """The whole fused linear, packed layout included, bit for bit against float64: inputs whose every group
    holds a +-127 multiple of 2^-e quantize exactly (scale 2^-e), and power-of-two weight scales keep every
    float sum exact, whatever the layout's summation order."""
    gen = torch.Generator().manual_seed(G + N + M)
    layer = Int8Linear(K, N, bias=False, group_size=G)
    layer.weight = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8)
    layer.weight_scale = 2.0 ** -torch.randint(0, 3, (N, K // G), generator=gen).float()
    q = torch.randint(-127, 128, (M, K), generator=gen, dtype=torch.int8)
    q.view(M, K // G, G)[:, :, 0] = 127  # every group's absmax is 127
    x_scale = 2.0 ** -torch.randint(0, 3, (M, K // G), generator=gen).float()
    x = (q.float().view(M, K // G, G) * x_scale[..., None]).view(M, K)
    plan.on_kernel(layer)
    y = layer(x)
    assert torch.equal(y.double(), reference(q, x_scale, layer.weight, layer.weight_scale))
    assert_rows_alone(layer, x, y)


@pytest.mark.parametrize("M", [2, 13])
def test_grouped_linear_is_exact_across_chunks_of_k(M):
    """K = 4,128: the packed kernel walks it in chunks of 2,048 inputs, keeping partial sums in the output."""
    test_grouped_linear_is_exact_with_dyadic_scales(32, 48, M, K=4128)


def test_weights_are_packed_once_at_load():
    kernel = native.kernel()
    layer = plan.on_kernel(Int8Linear.from_float(torch.nn.Linear(64, 32), group_size=32))
    w, scale = layer.kernel_weight
    path = kernel.int8_path()
    if path in ("dpbusd", "maddubs"):  # panels of 16 channels x 4 inputs: unsigned bytes w + 128, or signed w
        offset, dtype = (128, torch.uint8) if path == "dpbusd" else (0, torch.int8)
        assert w.shape == (2, 16, 16, 4) and w.dtype == dtype and scale.shape == (2, 2, 16)
        assert int(w[1, 3, 5, 2]) == int(layer.weight[16 + 5, 3 * 4 + 2]) + offset
        assert scale[1, 1, 5] == layer.weight_scale[16 + 5, 1]
        assert layer.state_dict()["weight"].shape == (32, 64)  # checkpoints and exports keep the plain layout
    else:
        assert w is layer.weight


def panel_sums(q, x_scale, w, w_scale) -> torch.Tensor:
    """The panels' arithmetic (csrc/int8/int8_panel_avx512.cpp), emulated: each channel takes, group by group in order,
    acc = fma(float32(exact group dot), float32(w_scale * x_scale), acc) in float32. float64 holds the product
    exactly, so rounding its sum with acc once to float32 is the fused multiply-add (double rounding aside,
    which needs a tie 2^-29 apart: not in these random values)."""
    M, groups = x_scale.shape
    dots = torch.einsum("mgk,ngk->mng", q.double().view(M, groups, -1), w.double().view(w.shape[0], groups, -1))
    scales = (w_scale[None, :, :] * x_scale[:, None, :]).double()  # float32 products, as the kernel rounds them
    acc = torch.zeros(M, w.shape[0], dtype=torch.float32)
    for g in range(groups):
        acc = (dots[:, :, g].float().double() * scales[:, :, g] + acc.double()).float()
    return acc


@pytest.mark.parametrize("G,K", [(32, 576), (64, 192), (32, 4128)])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 6, 7, 13])
def test_packed_panels_are_the_same_floats_on_every_cpu_kind(G, K, M):
    """Signed panels (maddubs, AVX2) and unsigned ones (dpbusd, AVX-512 VNNI) take each channel's groups in order
    with one fused multiply-add each: the same floats, so an AVX2 CPU and a VNNI CPU give the same logits. Checked
    against that arithmetic emulated in torch, on real-valued scales, K in chunks (4,128) and every row block."""
    kernel = native.kernel()
    path = kernel.int8_path()
    if path not in ("dpbusd", "maddubs"):
        pytest.skip(f"no packed panels on the {path} path")
    gen = torch.Generator().manual_seed(G + K + M)
    N = 48
    w = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8)
    w_scale = torch.rand(N, K // G, generator=gen) / 100 + 1e-4
    x = torch.randn(M, K, generator=gen) * 3
    q, x_scale = quantize_groups(x, G)
    packed = pack_int8_panels(w, w_scale, unsigned=path == "dpbusd")
    y = kernel.w8a8_linear(x, *packed, torch.empty(0))
    assert torch.equal(y, panel_sums(q, x_scale, w, w_scale))
    assert_rows_alone(lambda rows: kernel.w8a8_linear(rows, *packed, torch.empty(0)), x, y)


def test_packed_weights_the_cpu_cannot_run_are_refused():
    kernel = native.kernel()
    if kernel.int8_path() == "dpbusd":
        pytest.skip("this CPU runs both layouts")
    w, scale = pack_int8_panels(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16, 2), unsigned=True)
    with pytest.raises(RuntimeError, match="need the dpbusd path"):
        kernel.w8a8_linear(torch.randn(2, 64), w, scale, torch.empty(0))


@pytest.mark.parametrize("group_size", [0, 32])
def test_every_prefetch_policy_gives_the_same_results(group_size):
    """The int8 loops prefetch into L1 or L2 (under 'auto' chosen per CPU vendor, path and rows): a choice of speed,
    never of values."""
    kernel = native.kernel()
    torch.manual_seed(group_size)
    layer = plan.on_kernel(Int8Linear.from_float(torch.nn.Linear(576, 320), group_size=group_size))
    x = torch.randn(7, 576) * 3
    before = kernel.prefetch()
    try:
        results = {name: [layer(x[:m]) for m in (1, 2, 6, 7)] for name in ("l1", "l2", "auto") if kernel.use_prefetch(name)}
        assert kernel.prefetch().startswith("auto")  # and names what auto picks on this CPU
    finally:
        kernel.use_prefetch(before)
    assert all(torch.equal(a, b) for a, b in zip(results["l1"], results["l2"]))
    assert all(torch.equal(a, b) for a, b in zip(results["l1"], results["auto"]))
    with pytest.raises(RuntimeError, match="choose auto, l1 or l2"):
        kernel.use_prefetch("l3")
    assert kernel.prefetch() == before


def two_pass(linear: torch.nn.Linear, G: int) -> Int8Linear:
    layer = Int8Linear.from_float(linear, group_size=G)
    layer.activation_passes = 2
    return layer


@pytest.mark.parametrize("G", [0, 32])
@pytest.mark.parametrize("M", [1, 6, 17])
def test_two_activation_passes_see_the_inputs_at_about_fifteen_bits(G, M):
    """activation_passes=2 quantizes the activations' rounding residual again: against the exact product of the layer's
    int8 weights with the unrounded inputs, its error is a small fraction of one pass's (about 1/254), on the torch path
    and on the kernel alike, the kernel within float rounding of the torch path."""
    torch.manual_seed(M + G)
    linear = torch.nn.Linear(576, 200)
    one, two = Int8Linear.from_float(linear, group_size=G), two_pass(linear, G)
    x = torch.randn(M, 576) * 3
    x[0, :32] = 0  # an all-zero group in both passes: scale 1, no NaN
    exact = x.double() @ dequantize(two.weight, two.weight_scale).double().T + linear.bias.double()
    error = {name: (layer(x).double() - exact).abs().max().item() for name, layer in (("one", one), ("two", two))}
    assert error["two"] < error["one"] / 50
    fused = plan.on_kernel(two_pass(linear, G))
    assert fused.kernel_args()[0].name == "W8A8_RESIDUAL" and "activation_passes=2" in repr(fused)
    y = fused(x)
    assert torch.allclose(y, two(x), rtol=1e-5, atol=1e-5)
    assert (y.double() - exact).abs().max().item() < error["one"] / 50
    assert_rows_alone(fused, x, y, prefixes=True)


@pytest.mark.parametrize("M", [1, 3, 7])
def test_two_activation_passes_on_panels_are_the_sum_of_two_panel_products(M, K=576, G=32):
    """The kernel's residual is the torch reference's (x - q1 * s1, each step rounded to float32) and both passes take
    the panels' arithmetic: y = panels(q1) + panels(q2) bit for bit, on an AVX2 CPU as on a VNNI one."""
    kernel = native.kernel()
    path = kernel.int8_path()
    if path not in ("dpbusd", "maddubs"):
        pytest.skip(f"no packed panels on the {path} path")
    gen = torch.Generator().manual_seed(M)
    w = torch.randint(-128, 128, (48, K), generator=gen, dtype=torch.int8)
    w_scale = torch.rand(48, K // G, generator=gen) / 100 + 1e-4
    bias = torch.randn(48, generator=gen)
    x = torch.randn(M, K, generator=gen) * 3
    q1, s1 = quantize_groups(x, G)
    q2, s2 = quantize_groups(x - dequantize(q1, s1), G)
    packed = pack_int8_panels(w, w_scale, unsigned=path == "dpbusd")
    y = kernel.w8a8_residual_linear(x, *packed, bias)
    assert torch.equal(y, panel_sums(q1, s1, w, w_scale) + panel_sums(q2, s2, w, w_scale) + bias)
