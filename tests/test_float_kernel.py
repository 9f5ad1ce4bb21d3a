"""quasar's float-activation kernels (csrc/float_dot.cpp): float32 x times float32, bf16 or int8 weights, and
bf16 x bf16 as vdpbf16ps sums. Every path this CPU runs gives the same floats, every row is independent of
the other rows, and the fp32 and bf16 verifiers run on them."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_kernels

from quasar import backends, native
from quasar.quant.bf16 import BF16Linear, KernelBF16Linear

pytestmark = needs_kernels
E = torch.empty(0)
SHAPES = [(1, 64, 48), (5, 96, 37), (13, 576, 70), (9, 1536, 130)]  # M, K, N: tails of every tile shape


@pytest.fixture
def kernel():
    k = native.kernel()
    yield k
    k.use_float_path("auto")


def on_every_path(kernel, op):
    """op() on each float path this CPU runs -> {path: result}."""
    results = {}
    for path in kernel.float_paths():
        assert kernel.use_float_path(path) == path
        results[path] = op()
    return results


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
    alone = torch.cat([kernel.float_act_linear(x[m : m + 1], w, scale, bias) for m in range(M)])
    assert torch.equal(alone, y)


@pytest.mark.parametrize("M,K,N", [s for s in SHAPES if s[1] % 32 == 0])
def test_bf16_inputs_are_the_same_on_every_path_and_row_by_row(kernel, M, K, N):
    torch.manual_seed(M + N)
    x, w, bias = torch.randn(M, K), torch.randn(N, K).to(torch.bfloat16), torch.randn(N)
    y = assert_same_everywhere(on_every_path(kernel, lambda: kernel.bf16_linear(x, w, bias)))
    exact = x.to(torch.bfloat16).double() @ w.double().T + bias.double()  # the products of bf16 are exact
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    alone = torch.cat([kernel.bf16_linear(x[m : m + 1], w, bias) for m in range(M)])
    assert torch.equal(alone, y)


def test_bf16_inputs_round_as_torch_does_ties_to_even_and_nan(kernel):
    """A row rounds to bf16 exactly as x.to(torch.bfloat16): the kernel gives the same floats for both."""
    base = torch.tensor([1.0, 1.0078125, -3.0, 2.0**-20, 65504.0, -0.5, 3.0 * 2.0**-120, 7.0])  # low 16 bits zero
    ties = (base.view(torch.int32) | 0x8000).view(torch.float32)  # exactly half way: to the even neighbour
    above = (base.view(torch.int32) | 0x8001).view(torch.float32)
    x = torch.cat([ties, above, torch.randn(48)]).reshape(1, 64)
    w = torch.randn(16, 64).to(torch.bfloat16)
    for path in kernel.float_paths():
        kernel.use_float_path(path)
        assert torch.equal(kernel.bf16_linear(x, w, E), kernel.bf16_linear(x.to(torch.bfloat16).float(), w, E))
    nan = x.clone()
    nan[0, 3] = float("nan")
    assert kernel.bf16_linear(nan, w, E).isnan().all()


def test_bf16_input_layer_on_torch_and_on_the_kernel_agree():
    torch.manual_seed(2)
    linear = torch.nn.Linear(576, 200)
    layer = BF16Linear.from_linear(linear, bf16_inputs=True)
    x = torch.randn(3, 4, 576)
    on_torch = layer(x)
    on_kernel = backends.on_kernel(layer)(x)
    assert isinstance(layer, KernelBF16Linear) and layer.kernel_args()[0] == 2
    assert torch.allclose(on_kernel, on_torch, rtol=1e-4, atol=1e-4)
    assert BF16Linear.from_linear(torch.nn.Linear(48, 8), bf16_inputs=True).kernel_form() is None  # K % 32


def test_fp32_and_bf16_verifiers_run_on_the_float_kernels(tiny_model_dir):
    from quasar.loading import load
    from quasar.verifiers import load_verifier

    kernel = native.kernel()
    reference = load(tiny_model_dir, "fp32").model  # on torch: never prepared
    ids = torch.randint(0, 1000, (1, 12))
    with torch.inference_mode():
        expected = reference(ids, reference.new_cache(16))
        for name, tolerance in (("fp32", 1e-4), ("bf16", 0.05)):
            model = load_verifier(tiny_model_dir, name).model
            assert model.backend == f"kernels:{kernel.float_path()}", name
            got = model(ids, model.new_cache(16))
            assert (got - expected).abs().max() <= tolerance * expected.abs().max(), name
        w8a8 = load_verifier(tiny_model_dir, "w8a8").model
    assert w8a8.backend == f"kernels:{kernel.int8_path()}+{kernel.float_path()}"  # int8 layers, bf16 lm_head
