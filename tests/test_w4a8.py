"""W4A8 from a GGUF's own blocks: the unpacked blocks dequantize as gguf does, the torch reference follows its formula
(close to float64), every kernel path gives the reference's floats bit for bit over the whole quant range, group and
block tails and 1-17 rows, and a row's result depends on its own input only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from helpers import default_source, assert_rows_alone
from conftest import needs_kernels

from quasar.kernels import native, plan
from quasar.kernels.quant_layers import KernelW4A8Linear, KernelW6A8Linear
from quasar.model.gguf_blocks import ByteBlocks, FourBitBlocks, SixBitBlocks, unpack
from quasar.quant.int8 import Int8Linear, quantize_tokens
from quasar.quant.w4a8 import W4A8Linear, W6A8Linear, block_size, quantize_4bit

BLOCK_BYTES = {T.Q4_0: (32, 18), T.Q4_1: (32, 20), T.Q5_0: (32, 22), T.Q5_1: (32, 24), T.Q4_K: (256, 144),
               T.Q5_K: (256, 176), T.Q6_K: (256, 210)}
SCALES_AT = {T.Q4_0: slice(0, 2), T.Q4_1: slice(0, 4), T.Q5_0: slice(0, 2), T.Q5_1: slice(0, 4), T.Q4_K: slice(0, 4),
             T.Q5_K: slice(0, 4), T.Q6_K: slice(208, 210)}  # float16
LARGEST = {T.Q4_0: 15, T.Q4_1: 15, T.Q5_0: 31, T.Q5_1: 31, T.Q4_K: 15, T.Q5_K: 31, T.Q6_K: 63}
FOUR_AND_FIVE_BITS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K]
PATHS = native.kernel().int8_paths() if native.kernel() is not None else []


def random_blocks(qtype, rows: int, K: int, seed: int = 0) -> np.ndarray:
    """Raw blocks of random bytes with finite float16 scales: any quant, scale and min the format can hold."""
    rng = np.random.default_rng(seed)
    size, width = BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (rows, K // size, width), dtype=np.uint8)
    at = SCALES_AT[qtype]
    halves = rng.normal(0, 0.02, (rows, K // size, (at.stop - at.start) // 2)).astype(np.float16)
    raw[..., at] = halves.view(np.uint8).reshape(rows, K // size, -1)
    return raw.reshape(rows, -1)


def layer_class(qtype):
    return W6A8Linear if qtype == T.Q6_K else W4A8Linear


@pytest.mark.parametrize("qtype", [*FOUR_AND_FIVE_BITS, T.Q6_K])
def test_quant_blocks_dequantize_as_gguf_does(qtype):
    raw = random_blocks(qtype, 5, 512, seed=int(qtype))
    blocks = unpack(raw, qtype, 5)
    assert isinstance(blocks, SixBitBlocks if qtype == T.Q6_K else FourBitBlocks)
    assert int(blocks.q.max()) == LARGEST[qtype]
    assert torch.equal(blocks.dequantize(), torch.from_numpy(dequantize(raw, qtype).reshape(5, 512)))
    assert torch.equal(layer_class(qtype).from_blocks(blocks).dequantize(), blocks.dequantize())


def test_byte_blocks_hold_the_files_values():
    w = np.random.default_rng(1).normal(0, 0.05, (6, 128)).astype(np.float32)
    w[0, :32] = 0  # a block whose d is 0
    raw = quantize(w, T.Q8_0)
    blocks = unpack(raw, T.Q8_0, 6)
    assert isinstance(blocks, ByteBlocks)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(dequantize(raw, T.Q8_0).reshape(6, 128)))


def test_legacy_five_bit_blocks_of_a_real_weight_are_read_at_five_bits():
    """Q5_0 and Q5_1 as gguf quantizes a weight (a block whose d is 0 among them): the file's quants and scales, not
    int8 values."""
    w = np.random.default_rng(1).normal(0, 0.05, (6, 128)).astype(np.float32)
    w[0, :32] = 0
    for qtype in (T.Q5_0, T.Q5_1):
        raw = quantize(w, qtype)
        blocks = unpack(raw, qtype, 6)
        assert isinstance(blocks, FourBitBlocks) and blocks.bits == 5 and blocks.block == 32
        assert torch.equal(blocks.dequantize(), torch.from_numpy(dequantize(raw, qtype).reshape(6, 128)))


def test_types_without_a_block_form_are_left_out():
    assert unpack(np.zeros((2, 110), dtype=np.uint8), T.Q3_K, 2) is None


def layer_of(qtype, N: int, K: int, bias: bool, seed: int):
    blocks = unpack(random_blocks(qtype, N, K, seed), qtype, N)
    b = torch.randn(N, generator=torch.Generator().manual_seed(seed)) if bias else None
    return layer_class(qtype).from_blocks(blocks, b)


@pytest.mark.parametrize("qtype", [*FOUR_AND_FIVE_BITS, T.Q6_K])
def test_reference_is_the_dequantized_product_up_to_activation_rounding(qtype):
    """Against float64 on the same int8 inputs: only the float32 rounding of five operations per group differs."""
    layer = layer_of(qtype, 32, 512, True, 3)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    xq, xs = quantize_tokens(x, 32)
    x_rounded = (xq.double().view(4, 16, 32) * xs.double()[..., None]).view(4, 512)
    exact = x_rounded @ layer.dequantize().double().t() + layer.bias.double()
    assert torch.allclose(layer(x).double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    assert not torch.equal(layer(x).double(), exact)  # float32 rounding: the check can tell


@needs_kernels
@pytest.mark.parametrize("path", ["auto", *PATHS])
@pytest.mark.parametrize("qtype,K", [(T.Q4_0, 96), (T.Q4_1, 576), (T.Q5_0, 96), (T.Q5_1, 576), (T.Q4_K, 256),
                                     (T.Q4_K, 1536), (T.Q4_K, 2304), (T.Q5_K, 256), (T.Q5_K, 2304), (T.Q6_K, 256),
                                     (T.Q6_K, 2304)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17])
def test_every_path_gives_the_references_floats(path, qtype, K, M):
    """Random blocks cover every quant (0-15, 0-31 on Q5_*, 0-63 on Q6_K), the K-quants' 6-bit sc and m up to 63,
    Q6_K's signed sc from -128 to 127, negative mins, tails of row blocks (1-17 rows), panel tiles (N = 48: three
    panels) and chunks of K (2304 = 9 super-blocks)."""
    layer = layer_of(qtype, 48, K, M % 2 == 1, seed=K + M)
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen) * torch.rand(M, 1, generator=gen) * 4
    x[0, :40] = 0  # an all-zero group: scale 1, sum 0
    want = layer(x)
    panels, scales = plan.on_kernel(layer_of(qtype, 48, K, M % 2 == 1, seed=K + M)).kernel_weight
    bias = layer.bias if layer.bias is not None else torch.empty(0)
    got = native.kernel().block_linear_on(path, x, [panels], [scales], [bias])[0]
    assert torch.equal(got, want)


@needs_kernels
def test_mixed_blocks_of_one_input_share_its_quantization():
    """q/k in Q4_K and v in Q6_K (as Q4_K_M files hold them): one call gives each layer's own result."""
    layers = [plan.on_kernel(layer_of(qtype, 32, 512, True, seed)) for seed, qtype in enumerate([T.Q4_K, T.Q6_K])]
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(9))
    together = KernelW4A8Linear.forward_many(layers, x)
    assert all(torch.equal(y, layer(x)) for y, layer in zip(together, layers))


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K])
def test_kernel_rows_never_depend_on_the_other_rows(qtype):
    layer = plan.on_kernel(layer_of(qtype, 64, 512, True, 7))
    assert isinstance(layer, KernelW6A8Linear if qtype == T.Q6_K else KernelW4A8Linear)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(2))
    assert_rows_alone(layer, x, prefixes=True)


@needs_kernels
def test_the_files_q8_0_head_takes_its_activations_in_two_passes():
    """The default model's lm_head is its Q8_0 token table: the file's own weights, so the activations' rounding is its
    error, and two int8 passes cut it to a small fraction of one pass's against the float model's head."""
    from quasar.model.loading import load
    from quasar.verifiers.registry import load_verifier

    head = load_verifier(default_source(), "w4a8").model.lm_head
    assert head.activation_passes == 2
    h = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    exact = load(default_source(), "fp32").model.lm_head(h).double()
    two = (head(h).double() - exact).abs().max().item()
    head.activation_passes = 1
    one = (head(h).double() - exact).abs().max().item()
    assert two < one / 20


@needs_kernels
def test_kernel_refuses_malformed_weights():
    kernel = native.kernel()
    x = torch.zeros(1, 256)
    panels = torch.zeros(1, 8, 256, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="block panels uint8"):
        kernel.block_linear(x, torch.zeros(1, 4, 256, dtype=torch.uint8), torch.zeros(1, 1, 320, dtype=torch.uint8),
                            torch.empty(0))
    with pytest.raises(RuntimeError, match="block size"):
        kernel.block_linear(x, panels, torch.zeros(1, 1, 100, dtype=torch.uint8), torch.empty(0))
    with pytest.raises(RuntimeError, match="Q6_K block scales"):
        kernel.block_linear(x, torch.zeros(1, 8, 384, dtype=torch.uint8), torch.zeros(1, 1, 320, dtype=torch.uint8),
                            torch.empty(0))
    with pytest.raises(RuntimeError, match="K % 32"):
        kernel.block_linear(torch.zeros(1, 250), panels, torch.zeros(1, 1, 320, dtype=torch.uint8), torch.empty(0))


# ---- calibrated 4-bit blocks (w4a8:gN) --------------------------------------------------------------------------


def test_block_size_is_q4_k_s_where_it_divides_the_inputs():
    assert [block_size(k) for k in (1536, 8960, 576, 96, 896)] == [256, 256, 64, 32, 128]


@pytest.mark.parametrize("group", [32, 64])
def test_calibrated_blocks_hold_the_weight_within_half_a_step(group):
    """Min-max rounding: every weight within half a quant step of its group (plus the stored scales' rounding)."""
    w = torch.randn(48, 576, generator=torch.Generator().manual_seed(group)) * 0.05
    blocks = quantize_4bit(w, group, search=False)
    assert blocks.block == 64 and blocks.q.max() <= 15 and blocks.sc.max() == 255
    S = blocks.d.float().repeat_interleave(2, 1) * blocks.sc.float()  # [N, K/32]
    err = (blocks.dequantize() - w).abs().view(48, -1, 32)
    assert torch.all(err <= S[..., None] * 0.51 + 1e-3 * w.abs().max())
    if group == 64:  # a scale and a min per 64 inputs: both groups of 32 of a pair hold the same
        assert torch.equal(blocks.sc[:, 0::2], blocks.sc[:, 1::2]) and torch.equal(blocks.m[:, 0::2], blocks.m[:, 1::2])


def test_activation_aware_fit_lowers_the_output_error():
    """With inputs whose channels differ in size (as activations do), the fit to their mean squares gives a smaller
    expected output error than min-max rounding, and no larger a plain weight error than 1.5x."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 512, generator=gen) * 0.05
    x = torch.randn(256, 512, generator=gen) * torch.exp(torch.randn(512, generator=gen))  # channel scales spread
    importance = x.square().mean(0)
    aware, plain = quantize_4bit(w, 32, importance), quantize_4bit(w, 32, search=False)
    out_err = [((x @ (b.dequantize() - w).t()) ** 2).mean().item() for b in (aware, plain)]
    assert out_err[0] < 0.8 * out_err[1]


def correlated_inputs(gen: torch.Generator, rows: int, K: int) -> torch.Tensor:
    """Inputs whose channels are correlated and differ in size, as a layer's activations are."""
    mix = torch.randn(K // 8, K, generator=gen)
    return (torch.randn(rows, K // 8, generator=gen) @ mix + 0.1 * torch.randn(rows, K, generator=gen)) * torch.exp(
        0.5 * torch.randn(K, generator=gen))


def test_error_compensating_rounding_lowers_the_output_error():
    """GPTQ-style rounding keeps the fitted scales and mins and moves each quant's rounding error onto the inputs
    not yet rounded, weighted by the inputs' products: a smaller output error than rounding each weight alone."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 512, generator=gen) * 0.05
    x, held_out = correlated_inputs(gen, 4096, 512).split(2048)
    importance, hessian = x.square().mean(0), x.t() @ x
    fitted, compensated = quantize_4bit(w, 32, importance), quantize_4bit(w, 32, importance, hessian=hessian)
    for name in ("d", "dmin", "sc", "m"):
        assert torch.equal(getattr(fitted, name), getattr(compensated, name))
    assert compensated.q.max() <= 15 and compensated.source == "w4a8:g32"
    out_err = [((held_out @ (b.dequantize() - w).t()) ** 2).mean().item() for b in (fitted, compensated)]
    assert out_err[1] < 0.5 * out_err[0]


def test_error_compensation_ignores_inputs_that_are_never_seen():
    """A channel whose input is always zero takes no error and gets no weight error compensated through it."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=gen) * 0.05
    x = correlated_inputs(gen, 256, 64)
    x[:, 5] = 0
    blocks = quantize_4bit(w, 32, x.square().mean(0), hessian=x.t() @ x)
    assert torch.isfinite(blocks.dequantize()).all() and blocks.q.max() <= 15


def test_calibration_sums_input_products_once_per_shared_input(tiny_model):
    """The Hessian sums x^T x of each linear's inputs; linears reading the same input (q, k, v; gate, up) share one."""
    from quasar.quant.calibration import calibrate

    windows = [torch.tensor([[1, 5, 9, 20, 3, 7]]), torch.tensor([[4, 4, 2]])]
    calib = calibrate(tiny_model.model, windows, hessians=True)
    attn = "model.layers.0.self_attn."
    assert calib.hessians[attn + "q_proj"] is calib.hessians[attn + "k_proj"] is calib.hessians[attn + "v_proj"]
    assert calib.hessians[attn + "o_proj"] is not calib.hessians[attn + "q_proj"]
    K = tiny_model.model.config.hidden_size
    H = calib.hessians[attn + "q_proj"]
    assert H.shape == (K, K) and torch.allclose(H, H.t())
    assert torch.allclose(H.diagonal() / calib.tokens, calib.mean_square()[attn + "q_proj"].float(), rtol=1e-4)
    assert not calibrate(tiny_model.model, windows).hessians  # only when asked
    # the lm_head's inputs: every position's final norm, though the forward scores only the last
    assert calib.hessians["lm_head"].shape == (K, K) and calib.tokens == 9
    model, hidden = tiny_model.model, []
    handle = model.model.layers.register_forward_hook(lambda _, args, out: hidden.append(model.model.norm(out)))
    with torch.inference_mode():
        for ids in windows:
            model(ids, model.new_cache(8))
    handle.remove()
    rows = torch.cat([h.reshape(-1, K) for h in hidden]).double()  # all 9 positions
    assert torch.allclose(calib.squares["lm_head"], rows.square().sum(0))


def test_input_products_that_would_not_fit_the_free_memory_are_refused_before_the_forward(tiny_model, monkeypatch):
    """The x^T x sums' bytes are known before the forward (those of the distinct tensors a calibration keeps); where
    they exceed the free memory the calibration stops with one line naming the cheaper fit, no forward run."""
    from quasar.quant import calibration

    windows = [torch.tensor([[1, 5, 9, 20, 3, 7]])]
    sums = calibration.calibrate(tiny_model.model, windows, hessians=True).hessians
    distinct = {id(t): t for t in sums.values()}.values()
    assert calibration.products_bytes(tiny_model.model) == sum(t.numel() * t.element_size() for t in distinct)
    monkeypatch.setattr(calibration, "available_bytes", lambda: calibration.products_bytes(tiny_model.model) - 1)
    forwards = []
    monkeypatch.setattr(tiny_model.model, "forward", lambda *a, **k: forwards.append(a))
    with pytest.raises(ValueError, match=r"GiB.*use :awq"):
        calibration.calibrate(tiny_model.model, windows, hessians=True)
    assert not forwards
    assert not calibration.calibrate(tiny_model.model, windows).hessians  # without the sums: no check, no refusal


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_checkpoint_round_trip(tiny_model, tmp_path, method):
    """w4a8:g32 on a float model: W4A8 layers, the block recorded, reloaded bit-identically."""
    import copy

    from quasar.quant.calibration import CalibrationSpec
    from quasar.quant.checkpoint import load_quantized, save_quantized
    from quasar.quant.recipe import quantize_model, recipe_for
    from quasar.spec import VerifierSpec
    from quasar.verifiers.quantized import checkpoint_spec

    loaded = copy.deepcopy(tiny_model)
    spec = VerifierSpec.parse("w4a8:g32" if method == "awq" else f"w4a8:g32:{method}")
    block = quantize_model(loaded, recipe_for(spec, CalibrationSpec(samples=2, seq_len=32)))
    assert block["scheme"] == "w4a8" and block["method"] == method and block["calibration"] is not None
    assert checkpoint_spec(block) == VerifierSpec("w4a8", 32, method=method)
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj, W4A8Linear) and block["llama_cpp_fallbacks"]
    assert isinstance(loaded.model.lm_head, Int8Linear)  # 64 inputs: llama.cpp's Q8_0 fallback for the output layer
    ids = torch.tensor([[1, 5, 9, 20, 3]])
    with torch.inference_mode():
        want = loaded.model(ids, loaded.model.new_cache(8))
        reloaded = load_quantized(save_quantized(loaded, block, tmp_path / "w4"))
        assert torch.equal(reloaded.model(ids, reloaded.model.new_cache(8)), want)


def test_a_float_model_gets_calibrated_blocks(tiny_model_dir, tmp_path):
    from helpers import cache_at

    from quasar.verifiers.registry import load_verifier

    with cache_at(tmp_path / "cache"):
        calibrated = load_verifier(tiny_model_dir, "w4a8:rtn").model
    assert calibrated.plan.paths.startswith("kernels:") or native.kernel() is None
    assert any(isinstance(m, W4A8Linear) for m in calibrated.modules())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0])
def test_an_embedding_looked_up_in_blocks_gives_the_tables_rows(qtype):
    from quasar.model.gguf_blocks import BlockEmbedding

    if qtype == T.Q8_0:
        raw = quantize(np.random.default_rng(2).normal(0, 0.05, (40, 256)).astype(np.float32), qtype)
    else:
        raw = random_blocks(qtype, 40, 256, seed=3)
    blocks = unpack(raw, qtype, 40)
    table = BlockEmbedding(blocks)
    ids = torch.tensor([[3, 39, 0], [3, 7, 21]])
    assert torch.equal(table(ids), blocks.dequantize()[ids])
    assert table.kernel_table([5, 5, 9])[0] == [0, 1, 2]
    for step in ([5, 5, 9], [9, 12], list(range(40))):  # small steps from rows dequantized before, a prefill not
        assert torch.equal(table.kernel_table(step)[1], blocks.dequantize()[step])
    from quasar.model.gemma3 import ScaledEmbedding  # Gemma's: rows times sqrt(hidden), as its float table's

    gemma = ScaledEmbedding(40, 256)
    gemma.weight.data = blocks.dequantize()
    assert torch.equal(BlockEmbedding(blocks, gemma.multiplier)(ids), gemma(ids))


def test_the_w4a8_verifier_looks_tokens_up_in_the_files_blocks():
    """The default model's token table in its own blocks instead of float32, and the same logits."""
    from quasar.model.gguf_blocks import BlockEmbedding
    from quasar.model.loading import load
    from quasar.verifiers.registry import load_verifier

    model = load_verifier(default_source(), "w4a8").model
    assert isinstance(model.model.embed_tokens, BlockEmbedding)
    ids = torch.tensor([[1, 500, 9000, 49151]])
    assert torch.equal(model.model.embed_tokens(ids), load(default_source(), "fp32").model.model.embed_tokens(ids))


def test_a_gptq_checkpoint_from_the_cli_decodes_speculative_as_plain(tiny_model_dir, tmp_path):
    """`quasar quantize --scheme w4a8:g32:gptq` writes a checkpoint that records its method, loads as that verifier,
    and decodes greedy speculative token for token as plain."""
    import json

    from quasar.cli import main
    from quasar.decoding.drafters import build_drafter
    from quasar.decoding.engine import Engine
    from quasar.decoding.sampling import SamplingParams
    from quasar.decoding.speculative import Speculative
    from quasar.verifiers.registry import load_verifier

    out = tmp_path / "gptq"
    assert main(["quantize", "--model", str(tiny_model_dir), "--out", str(out), "--scheme", "w4a8:g32:gptq",
                 "--calib-samples", "2", "--seq-len", "32"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization"]["method"] == "gptq"
    target = load_verifier(out, "w4a8:g32:gptq")
    assert any(isinstance(m, (W4A8Linear, KernelW4A8Linear)) for m in target.model.modules())
    ids = [1, 5, 9, 20, 3, 7, 1, 5, 9, 20, 3, 7, 1, 5]
    params = SamplingParams(max_new_tokens=24)
    plain = Engine(target).generate(ids, params)
    spec = Engine(target, decoder=Speculative(build_drafter("ngram", target), k=4)).generate(ids, params)
    assert spec.token_ids == plain.token_ids and spec.stats.verify_steps < len(plain.token_ids)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K])
def test_panels_packed_a_few_channels_at_a_time_equal_one_pass(qtype, monkeypatch):
    """The packing walks the channels in ranges (a large lm_head's temporaries stay small): the ranges' seams change no
    byte of the panels or the block scales."""
    from quasar.kernels import quant_layers

    layer = layer_of(qtype, 80, 512, bias=False, seed=3)
    pack = quant_layers.pack_w6_panels if qtype == T.Q6_K else quant_layers.pack_w4_panels
    whole = pack(layer)
    monkeypatch.setattr(quant_layers, "PACK_CHANNELS", 32)  # 80 channels: ranges of 32, 32 and 16
    ranges = pack(layer)
    assert all(torch.equal(a, b) for a, b in zip(whole, ranges))


def test_blocks_read_with_the_files_pages_released_equal_a_fresh_read():
    """Each tensor's file pages leave the process once unpacked; the mapping still reads the same bytes after."""
    from quasar.model.gguf_blocks import linear_blocks, tensor_blocks
    from quasar.model.loading import default_model_path, map_gguf, open_gguf

    path = default_model_path()
    read = linear_blocks(map_gguf(path), {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3})
    name = "model.layers.0.mlp.down_proj.weight"
    first = read[name]()
    again = read[name]()  # its pages were released after the first read: paged in again
    fresh = tensor_blocks(next(t for t in open_gguf(path).tensors if t.name == "blk.0.ffn_down.weight"))
    for blocks in (again, fresh):
        assert all(torch.equal(getattr(first, f), getattr(blocks, f)) for f in ("q", "d", "sc")
                   if isinstance(getattr(first, f, None), torch.Tensor))


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q4_K, T.Q6_K])
def test_a_forwards_bytes_count_the_packed_blocks(qtype):
    """The memory wall of a w4a8 verifier: the panels and block scales its kernels read, not the plain blocks beside them."""
    from quasar.tools.bench.bandwidth import bytes_per_forward

    layer = plan.on_kernel(layer_of(qtype, 64, 512, bias=True, seed=1))
    packed = sum(t.numel() * t.element_size() for t in layer.kernel_weight)
    assert bytes_per_forward(torch.nn.Sequential(layer)) == packed + 64 * 4  # and the float32 bias
    assert layer.drop_plain_()
    assert bytes_per_forward(torch.nn.Sequential(layer)) == packed + 64 * 4
    # a weight, scales included (docs/kernels.md): Q4_0 and Q5_1 keep d and dmin alone per 32 inputs
    bits = {T.Q4_0: (5.0, 5.0), T.Q5_1: (6.0, 6.0), T.Q4_K: (4.62, 4.63), T.Q6_K: (6.56, 6.57)}[qtype]
    assert bits[0] <= 8 * packed / (64 * 512) <= bits[1]


@needs_kernels
@pytest.mark.parametrize("path", ["auto", *PATHS])
@pytest.mark.parametrize("bits", [4, 5])
def test_fitted_blocks_of_32_inputs_keep_their_scales_and_mins(path, bits):
    """A fit where 64 does not divide K has blocks of 32 inputs whose sc and m are not 1: packed with them (unlike a
    Q4_1 file's), and every path still gives the reference's floats."""
    linear = torch.nn.Linear(96, 48)
    torch.nn.init.normal_(linear.weight, std=0.05, generator=torch.Generator().manual_seed(bits))
    layer = W4A8Linear.from_float(linear, bits=bits)
    assert layer.block == 32 and bool((layer.sc != 1).any())
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    panels, scales = plan.on_kernel(W4A8Linear.from_float(linear, bits=bits)).kernel_weight
    assert scales.shape[-1] == 64 + 32
    assert torch.equal(native.kernel().block_linear_on(path, x, [panels], [scales], [layer.bias])[0], layer(x))


def test_fitted_blocks_take_llama_cpps_bits_where_it_gives_more():
    """As llama.cpp's Q4_K_M: 5-bit blocks where K-quants' 256 inputs do not divide K (its Q5_0), int8 per 32 inputs
    where it gives 6 bits or more (an lm_head of such a width: its Q8_0; v_proj and down_proj in its more-bits layers:
    Q6_K or Q8_0), 4-bit blocks elsewhere; a checkpoint that records no fallbacks (written before them) loads as
    all 4-bit."""
    from quasar.quant.recipe import recipe_for
    from quasar.quant.schemes import SCHEMES, Place, W4A8Config, more_bits, scheme_config
    from quasar.spec import VerifierSpec

    assert [i for i in range(18) if more_bits(i, 18)] == [0, 1, 4, 7, 10, 13, 15, 16, 17]  # Gemma 3 270M's Q8_0 attn_v
    cfg = recipe_for(VerifierSpec.parse("w4a8:g32")).scheme_config()
    scheme = SCHEMES[W4A8Config]
    gen = torch.Generator().manual_seed(0)
    cases = [("model.layers.2.mlp.up_proj", 2, 640, (5, 128)), ("model.layers.2.mlp.up_proj", 2, 512, (4, 256)),
             ("lm_head", None, 1536, (4, 256)), ("model.layers.3.self_attn.q_proj", 3, 96, (5, 32)),
             ("model.layers.2.mlp.down_proj", 2, 512, (4, 256)), ("model.layers.2.self_attn.v_proj", 2, 640, (5, 128)),
             ("model.layers.4.mlp.down_proj", 4, 512, 32), ("model.layers.0.self_attn.v_proj", 0, 640, 32),
             ("lm_head", None, 640, 32)]
    for name, layer, K, want in cases:
        place = Place(name, layer, 18)
        linear = torch.nn.Linear(K, 32, bias=False)
        torch.nn.init.normal_(linear.weight, generator=gen)
        fitted, empty = scheme.from_float(linear, cfg, None, None, place), scheme.empty(K, 32, False, cfg, place)
        got = (fitted.bits, fitted.block) if isinstance(fitted, W4A8Linear) else fitted.group_size
        assert got == want and type(fitted) is type(empty) and set(fitted.state_dict()) == set(empty.state_dict()), name
        assert isinstance(fitted, Int8Linear) == isinstance(want, int)
    old = scheme_config("w4a8")
    for name, layer in [("model.layers.0.self_attn.v_proj", 0), ("lm_head", None)]:
        empty = scheme.empty(640, 32, False, old, Place(name, layer, 18))
        assert isinstance(empty, W4A8Linear) and empty.bits == 4


def test_five_bit_fit_holds_the_weight_within_half_a_step():
    w = torch.randn(48, 640, generator=torch.Generator().manual_seed(5)) * 0.05
    blocks = quantize_4bit(w, 32, search=False, bits=5)
    assert blocks.bits == 5 and blocks.block == 128 and blocks.q.max() == 31 and blocks.sc.max() == 255
    S = blocks.d.float().repeat_interleave(4, 1) * blocks.sc.float()  # [N, K/32]
    err = (blocks.dequantize() - w).abs().view(48, -1, 32)
    assert torch.all(err <= S[..., None] * 0.51 + 1e-3 * w.abs().max())
    four = quantize_4bit(w, 32, search=False)
    assert (blocks.dequantize() - w).square().mean() < 0.35 * (four.dequantize() - w).square().mean()


@needs_kernels
@pytest.mark.parametrize("path", ["auto", *PATHS])
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_fitted_five_bit_blocks_of_a_narrow_input_give_the_references_floats(path, method):
    """K = 640 (Gemma 3 270M's width): 5-bit quants in blocks of 128 inputs, on every path, 1-7 rows."""
    gen = torch.Generator().manual_seed(11)
    w, x = torch.randn(48, 640, generator=gen) * 0.05, torch.randn(64, 640, generator=gen)
    hessian = x.t() @ x if method == "gptq" else None
    layer = W4A8Linear.from_blocks(quantize_4bit(w, 32, search=False, bits=5, hessian=hessian), torch.randn(48, generator=gen))
    assert layer.bits == 5 and layer.dequantize().sub(w).abs().max() < 0.05
    panels, scales = plan.on_kernel(W4A8Linear.from_blocks(quantize_4bit(w, 32, search=False, bits=5, hessian=hessian),
                                                           layer.bias)).kernel_weight
    for M in range(1, 8):
        rows = x[:M] * (M / 3)
        assert torch.equal(native.kernel().block_linear_on(path, rows, [panels], [scales], [layer.bias])[0], layer(rows))


@pytest.mark.parametrize("search", [False, True])
@pytest.mark.parametrize("grid,bits", [("q4_1", 5), ("q5_0", 5), ("q4_k", 4)])
def test_weights_on_a_grid_keep_it(search, grid, bits):
    """A dequantized GGUF file's weights lie on a grid per 32 inputs: Q4_1's 4 bits (the default model's float weights)
    in 5-bit blocks, Q5_0's symmetric 5 bits (Gemma 3's 640-wide tensors) and Q4_K's 4 bits, whose groups need not
    reach both ends of their grids, in their own widths: the fit tries spans of fewer steps and holds them within the
    stored scales' rounding."""
    gen = torch.Generator().manual_seed(4)
    step = torch.rand(32, 20, 1, generator=gen) * 0.01 + 0.001  # [N, groups, 1]: 20 groups of 32 inputs
    top = 31 if grid == "q5_0" else 15
    q = torch.randint(0, top + 1, (32, 20, 32), generator=gen)
    if grid == "q4_1":  # each group spans its grid, zero inside it (as a Q4_1 group of a real weight)
        q[..., 0], q[..., 1] = 0, 15
        w = step * (q - torch.randint(1, 15, (32, 20, 1), generator=gen))
    else:  # the top quants of a group unused (Q5_0: d (q - 16), its largest magnitude at q = 0; Q4_K: scale q - min)
        q = q.clamp(max=top - torch.randint(0, (top + 1) // 4, (32, 20, 1), generator=gen))
        q[..., 0] = 0
        w = step * (q - (16 if grid == "q5_0" else torch.randint(1, 6, (32, 20, 1), generator=gen)))
    w = w.view(32, 640)
    err = (quantize_4bit(w, 32, search=search, bits=bits).dequantize() - w).square().mean()
    assert err <= 0.01 * step.square().mean()  # a step's 1/100 in mean square: the stored scales' rounding only
