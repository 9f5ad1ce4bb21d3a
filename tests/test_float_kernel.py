"""quasar's float-activation kernels (csrc/float/float_dot*.cpp): float32 x times float32, bf16 or int8 weights, and
bf16 x bf16 as vdpbf16ps sums. Every path this CPU runs gives the same floats (but the amx path's bf16 x bf16,
which sums as AMX's tdpbf16ps: csrc/float/float_amx.cpp), every row is independent of the other rows, and the fp32
and bf16 verifiers run on them."""

from __future__ import annotations

import pytest
import torch
from helpers import default_source, assert_rows_alone
from conftest import needs_kernels

from quasar.kernels import native, plan
from quasar.kernels.layers import pack_channels
from quasar.kernels.quant_layers import KernelBF16Linear, pack_panels
from quasar.quant.bf16 import BF16Linear

pytestmark = needs_kernels
E = torch.empty(0)
SHAPES = [(1, 64, 48), (5, 96, 37), (13, 576, 70), (9, 1536, 130)]  # M, K, N: tails of every tile shape


@pytest.fixture
def kernel():
    k = native.kernel()
    yield k
    k.use_float_path("auto")


def on_every_path(kernel, op, paths=None):
    """op() on each float path this CPU runs (or on `paths`) -> {path: result}."""
    results = {}
    for path in paths or kernel.float_paths():
        assert kernel.use_float_path(path) == path
        results[path] = op()
    return results


def vdpbf16ps_paths(kernel) -> list[str]:
    """The paths whose bf16_linear sums as vdpbf16ps does: all but amx."""
    return [path for path in kernel.float_paths() if path != "amx"]


def assert_same_everywhere(results: dict[str, torch.Tensor]) -> torch.Tensor:
    first = next(iter(results.values()))
    for path, y in results.items():
        assert torch.equal(y, first), f"the {path} path differs"
    return first


def test_paths_fastest_first_with_avx2_last_and_unknown_names_rejected(kernel):
    paths = kernel.float_paths()
    assert paths[-1] == "avx2" and kernel.float_path() == paths[0]
    assert kernel.use_float_path("auto") == paths[0]
    with pytest.raises(RuntimeError, match="available: auto, .*avx2"):
        kernel.use_float_path("sse2")


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_float_activations_are_the_same_on_every_path_and_row_by_row(kernel, M, K, N, dtype):
    torch.manual_seed(M * N)
    x = torch.randn(M, K)
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8) if dtype == torch.int8 else torch.randn(N, K).to(dtype)
    scale, bias = torch.rand(N) + 0.5, torch.randn(N)
    y = assert_same_everywhere(on_every_path(kernel, lambda: kernel.float_act_linear(x, w, scale, bias)))
    expected = (x.double() @ w.double().T) * scale.double() + bias.double()
    assert torch.allclose(y.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    assert_rows_alone(lambda rows: kernel.float_act_linear(rows, w, scale, bias), x, y)


@pytest.mark.parametrize("M,K,N", [(1, 64, 48), (5, 6, 32), (13, 576, 80), (9, 1536, 144)])  # K past a chunk of 512
def test_bf16_inputs_are_the_same_on_every_path_and_row_by_row(kernel, M, K, N):
    torch.manual_seed(M + N)
    x, w, bias = torch.randn(M, K), torch.randn(N, K).to(torch.bfloat16), torch.randn(N)
    packed = pack_panels(w)
    assert packed[1, 2, 3, 1] == w[16 + 3, 2 * 2 + 1]
    y = assert_same_everywhere(on_every_path(kernel, lambda: kernel.bf16_linear(x, packed, bias), vdpbf16ps_paths(kernel)))
    exact = x.to(torch.bfloat16).double() @ w.double().T + bias.double()  # the products of bf16 are exact
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    assert_rows_alone(lambda rows: kernel.bf16_linear(rows, packed, bias), x, y)


def test_bf16_inputs_flush_denormals_as_vdpbf16ps_on_every_path(kernel):
    """vdpbf16ps is an FMA that reads denormals as zero and flushes denormal results: every path does the same
    (the FMA paths set DAZ/FTZ while they run), and leave the thread's float mode as it was."""
    K = 96
    x = torch.full((3, K), 2.0**-64)  # row 0: every product 2^-128, a denormal: each partial sum flushes to 0
    x[1] = 2.0**-60  # row 1: products 2^-120, normal: the sum is exact
    x[2] = torch.randn(K) * 2.0**-62
    x[2, :8] = 2.0**-130  # denormal inputs: read as zero
    w = torch.full((32, K), 2.0**-64).to(torch.bfloat16)
    w[16:] = (torch.randn(16, K) * 2.0**-62).to(torch.bfloat16)
    results = on_every_path(kernel, lambda: kernel.bf16_linear(x, pack_panels(w), E))
    assert_same_everywhere({path: results[path] for path in vdpbf16ps_paths(kernel)})
    for y in results.values():  # amx's tiles flush as vdpbf16ps does
        assert torch.equal(y[0, :16], torch.zeros(16))
        assert torch.equal(y[1, :16], torch.full((16,), K * 2.0**-124))
    tiny = torch.tensor([2.0**-140])
    assert (tiny * 2).item() == 2.0**-139  # denormals work again outside the kernel


# every tile shape (1 or 2 row tiles, whole or not), K in one chunk of 1,024 inputs or three
@pytest.mark.parametrize("M,K", [(1, 576), (5, 2080), (16, 576), (17, 2080), (32, 576), (45, 2080), (70, 576)])
def test_amx_bf16_is_close_to_the_exact_sum_and_row_by_row(kernel, M, K):
    """The amx path sums bf16 pairs on AMX tiles (tdpbf16ps): other floats than vdpbf16ps's, as close to the exact
    sum, and a row's result the same alone, in any split of the rows, and in tiles of any height."""
    if "amx" not in kernel.float_paths():
        pytest.skip("this CPU has no AMX-BF16")
    kernel.use_float_path("amx")
    torch.manual_seed(M)
    N = 80  # 5 panels: pairs of panels and a last single one
    x, w, bias = torch.randn(M, K), torch.randn(N, K).to(torch.bfloat16), torch.randn(N)
    packed = pack_panels(w)
    y = kernel.bf16_linear(x, packed, bias)
    exact = x.to(torch.bfloat16).double() @ w.double().T + bias.double()
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    assert_rows_alone(lambda rows: kernel.bf16_linear(rows, packed, bias), x, y)
    split = M // 3 + 1
    assert torch.equal(torch.cat([kernel.bf16_linear(x[:split], packed, bias), kernel.bf16_linear(x[split:], packed, bias)]), y)
    kernel.use_float_path("avx512")  # a K that is no whole number of tiles runs as on avx512
    odd = kernel.bf16_linear(x[:, :48], pack_panels(w[:, :48]), bias)
    kernel.use_float_path("amx")
    assert torch.equal(kernel.bf16_linear(x[:, :48], pack_panels(w[:, :48]), bias), odd)


@pytest.mark.parametrize("M,K,N", [(1, 64, 48), (5, 48, 32), (40, 576, 80)])
def test_bf16_linear_in_two_steps_is_bf16_linear(kernel, M, K, N):
    """Linears that share an input round it once (bf16_input), then multiply it (bf16_linear_rounded): the same floats
    on every path; an input rounded for another path, or not rounded, is refused."""
    torch.manual_seed(K)
    x, w, bias = torch.randn(M, K), torch.randn(N, K).to(torch.bfloat16), torch.randn(N)
    packed = pack_panels(w)
    for path in kernel.float_paths():
        kernel.use_float_path(path)
        rounded = kernel.bf16_input(x)
        assert torch.equal(rounded.float(), x.to(torch.bfloat16).float())
        assert torch.equal(kernel.bf16_linear_rounded(rounded, packed, bias), kernel.bf16_linear(x, packed, bias))
        other = rounded.float() if rounded.dtype == torch.bfloat16 else rounded.to(torch.bfloat16)
        with pytest.raises(RuntimeError, match="rounded"):
            kernel.bf16_linear_rounded(other, packed, bias)


def test_a_dead_large_result_serves_the_next_one_and_live_ones_never_share(kernel):
    """Results of 1 MB and more come from blocks the kernels keep (csrc/base/result_pool.cpp): a freed one is reused by the
    next result of its size, fully rewritten, while results that are alive keep blocks of their own."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 256), torch.randn(4096, 256).to(torch.bfloat16)  # a 1 MB result
    packed = pack_panels(w)
    first = kernel.bf16_linear(x, packed, E)
    expected, block = first.clone(), first.data_ptr()
    first.fill_(float("nan"))
    del first
    again = kernel.bf16_linear(x, packed, E)
    assert again.data_ptr() == block and torch.equal(again, expected)
    other = kernel.bf16_linear(x.flip(0), packed, E)  # while `again` lives
    assert other.data_ptr() != block and torch.equal(other, expected.flip(0))
    again.add_(1)  # an ordinary tensor: in place, views, copies
    assert torch.equal(again[:, :3], expected[:, :3] + 1) and torch.equal(other, expected.flip(0))
    small = kernel.bf16_linear(x[:1], packed, E)  # under 1 MB: torch.empty's
    assert torch.equal(small, expected[:1])


@pytest.mark.parametrize("M,K,N", [(1, 64, 48), (5, 7, 32), (13, 576, 80), (9, 1536, 144)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_fp32_is_the_same_on_every_path_and_row_by_row(kernel, M, K, N, dtype):
    torch.manual_seed(M * K)
    x, w, bias = torch.randn(M, K), torch.randn(N, K).to(dtype).float(), torch.randn(N)
    packed = pack_channels(w.to(dtype))
    assert packed[1, 2, 3] == w[16 + 3, 2]
    y = assert_same_everywhere(on_every_path(kernel, lambda: kernel.fp32_linear(x, packed, bias)))
    if dtype == torch.bfloat16:  # widened exactly: the floats of the same weights stored as float32
        assert torch.equal(y, kernel.fp32_linear(x, pack_channels(w), bias))
    chain = torch.zeros(M, N)  # one float32 FMA chain per output, k in order: the kernel's sum exactly
    for k in range(K):
        chain = torch.addcmul(chain, x[:, k : k + 1], w[:, k][None])
    assert torch.allclose(y, chain + bias, rtol=1e-5, atol=1e-5)  # addcmul rounds each product, an FMA does not
    expected = x.double() @ w.double().T + bias.double()
    assert torch.allclose(y.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    assert_rows_alone(lambda rows: kernel.fp32_linear(rows, packed, bias), x, y)


def test_bf16_inputs_round_as_torch_does_ties_to_even_and_nan(kernel):
    """A row rounds to bf16 exactly as x.to(torch.bfloat16): the kernel gives the same floats for both."""
    base = torch.tensor([1.0, 1.0078125, -3.0, 2.0**-20, 65504.0, -0.5, 3.0 * 2.0**-120, 7.0])  # low 16 bits zero
    ties = (base.view(torch.int32) | 0x8000).view(torch.float32)  # exactly half way: to the even neighbour
    above = (base.view(torch.int32) | 0x8001).view(torch.float32)
    x = torch.cat([ties, above, torch.randn(48)]).reshape(1, 64)
    w = pack_panels(torch.randn(16, 64).to(torch.bfloat16))
    for path in kernel.float_paths():
        kernel.use_float_path(path)
        assert torch.equal(kernel.bf16_linear(x, w, E), kernel.bf16_linear(x.to(torch.bfloat16).float(), w, E))
    nan = x.clone()
    nan[0, 3] = float("nan")
    assert kernel.bf16_linear(nan, w, E).isnan().all()


def test_bf16_input_layer_on_torch_and_on_the_kernel_agree():
    torch.manual_seed(2)
    linear = torch.nn.Linear(576, 208)
    layer = BF16Linear.from_linear(linear, bf16_inputs=True)
    x = torch.randn(3, 4, 576)
    on_torch = layer(x)
    on_kernel = plan.on_kernel(layer)(x)
    assert isinstance(layer, KernelBF16Linear) and layer.kernel_args()[0] == 2
    assert torch.allclose(on_kernel, on_torch, rtol=1e-4, atol=1e-4)
    assert plan.kernel_form(BF16Linear.from_linear(torch.nn.Linear(48, 8), bf16_inputs=True)) is None  # N % 16


def test_float32_input_layer_reads_packed_bf16_weights_where_n_allows():
    torch.manual_seed(3)
    for n, kind in ((208, 3), (200, 1)):  # N % 16: the plain weight on float_act_linear
        layer = BF16Linear.from_linear(torch.nn.Linear(576, n))
        x = torch.randn(2, 5, 576)
        on_torch = layer(x)
        on_kernel = plan.on_kernel(layer)(x)
        assert layer.kernel_args()[0] == kind
        assert torch.allclose(on_kernel, on_torch, rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.cat([layer(x[:, t : t + 1]) for t in range(5)], 1), on_kernel)  # rows independent


def test_fp32_and_bf16_verifiers_run_on_the_float_kernels(tiny_model_dir):
    from quasar.model.loading import load
    from quasar.verifiers.registry import load_verifier

    kernel = native.kernel()
    reference = load(tiny_model_dir, "fp32").model  # on torch: never prepared
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        expected = reference(ids, reference.new_cache(16))
        for name, tolerance in (("fp32", 1e-4), ("bf16", 0.05)):
            model = load_verifier(tiny_model_dir, name).model
            assert model.plan.paths == f"kernels:{kernel.float_path_for(name == 'bf16')}", name
            got = model(ids, model.new_cache(16))
            assert (got - expected).abs().max() <= tolerance * expected.abs().max(), name
            linears = [m for m in model.modules() if getattr(m, "packed", None) is not None]
            assert len(linears) == 2 * 7 + 1 and all(m.weight.data_ptr() == m.packed.data_ptr() for m in linears), name
        w8a8 = load_verifier(tiny_model_dir, "w8a8").model
        lmbf16 = load_verifier(tiny_model_dir, "w8a8:lmbf16").model
    assert w8a8.plan.paths == f"kernels:{kernel.int8_path()}"  # every linear int8, the lm_head too
    assert lmbf16.plan.paths == f"kernels:{kernel.int8_path()}+{kernel.float_path_for(False)}"  # int8 layers, bf16 lm_head


@pytest.mark.parametrize("name", ["bf16", "w8a8:lmbf16"])
def test_a_tied_lm_head_is_packed_once_and_the_embedding_looks_rows_up_in_it(name):
    from quasar.model.loading import load
    from quasar.kernels.layers import PanelEmbedding
    from quasar.verifiers.registry import load_verifier

    model = load_verifier(default_source(), name).model  # SmolLM2 ties lm_head and embedding
    table = load(default_source(), "bf16").model.model.embed_tokens.weight  # the plain [V, D] bf16 rows
    embedding = model.model.embed_tokens
    assert isinstance(embedding, PanelEmbedding) and model.lm_head.kernel_args()[0] == (2 if name == "bf16" else 3)
    assert embedding.weight.data_ptr() == model.lm_head.weight.data_ptr() == model.lm_head.packed.data_ptr()
    ids = torch.tensor([[0, 15, 16, 17, 4242, 49151]])
    assert torch.equal(embedding(ids), table[ids])
    up = model.model.layers[0].mlp.up_proj  # every packed linear of a loaded verifier: one copy of its weight
    packed = up.packed if name == "bf16" else up.kernel_weight[0]
    assert up.weight.data_ptr() == packed.data_ptr()
    if name != "bf16" and native.kernel().int8_path() == "dpbusd":
        assert up.weight.dtype == torch.uint8 and up.weight_scale.data_ptr() == up.kernel_weight[1].data_ptr()


def test_an_int8_lm_head_leaves_a_tied_embedding_its_float_rows():
    from quasar.model.loading import load
    from quasar.verifiers.registry import load_verifier

    model = load_verifier(default_source(), "w8a8").model  # the default scheme quantizes the tied lm_head too
    table = load(default_source(), "fp32").model.model.embed_tokens.weight
    assert model.lm_head.kernel_args()[0] == 0  # the int8 kind
    ids = torch.tensor([[0, 15, 16, 17, 4242, 49151]])
    assert torch.equal(model.model.embed_tokens(ids), table[ids])
