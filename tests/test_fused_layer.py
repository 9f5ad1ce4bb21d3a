"""The fused CPU path (quasar.kernels.native): one kernel call per decoder layer for decode and verify steps.

It must equal, bitwise, the same kernels called layer by layer from Python (the unfused path; for packed W8A8
steps of up to 32 rows the fused path runs every layer in one parallel region), stay
close to the plain float path, and give a token the same logits alone and inside a verify block, on
llama, qwen2 (q/k/v biases) and qwen3 (qk-norm) shapes and on W8A8, W8A16, bf16 (float32 or bf16 inputs)
and float32 linears; the bf16 verifier's attention on AMX tiles (bf16 inputs, head_dim 64) too.
"""

from __future__ import annotations

import pytest
import torch
from conftest import needs_kernels, tiny_hf_model, write_hf_dir

from quasar.kernels import native, plan
from quasar.model.llama import Tokens
from quasar.quant.bf16 import use_bf16_linears_
from quasar.quant.schemes import W8A8Config, W8A16Config, quantize_

pytestmark = needs_kernels


def make(kind: str, model_type: str, directory):
    from quasar.model.loading import load

    model = load(directory, "fp32").model
    if kind in ("bf16", "bf16-inputs"):
        use_bf16_linears_(model, bf16_inputs=kind == "bf16-inputs")
    elif kind.startswith("w8a8-g32"):  # the default verifier's scheme: packed panels, the layers in one region
        quantize_(model, W8A8Config(group_size=32, lm_head=kind == "w8a8-g32-head"))  # -head: the lm_head too
        if kind == "w8a8-g32":
            use_bf16_linears_(model, ["lm_head"])
    elif kind != "fp32":
        quantize_(model, W8A8Config() if kind == "w8a8" else W8A16Config())
        use_bf16_linears_(model, ["lm_head"])
    assert plan.prepare_(model).paths.startswith("kernels:")
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tmp_path_factory, tokenizer_dir):
    return write_hf_dir(tiny_hf_model(request.param, seed=3), tmp_path_factory.mktemp(request.param), tokenizer_dir)


def steps(model, fused: bool | None) -> list[torch.Tensor]:
    """Prefill 20 tokens, then a verify block of 5 and two single-token steps; logits of each step. fused None:
    the model stays on torch."""
    if fused is not None:
        plan.prepare_(model, fuse=fused)  # unfused: every layer through the Python modules, same kernels
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, 27))
    cache = model.new_cache(64)
    with torch.inference_mode():
        out = [model(ids[:, :20], cache), model(ids[:, 20:25], cache), model(ids[:, 25:26], cache), model(ids[:, 26:27], cache)]
    return out


@pytest.mark.parametrize("kind", ["w8a8", "w8a8-g32", "w8a8-g32-head", "w8a16", "bf16", "bf16-inputs", "fp32"])
def test_fused_layer_equals_the_unfused_kernels(kind, model_dir):
    model = make(kind, "", model_dir)
    for fused, unfused in zip(steps(model, True), steps(model, False)):
        assert torch.equal(fused, unfused)


@pytest.mark.parametrize("kind", ["w8a8-g32", "w8a8-g32-head", "w8a8", "w8a16", "bf16", "fp32"])
def test_small_steps_of_packed_w8a8_run_in_one_region(kind, model_dir):
    """A model whose linears are all packed W8A8 (group-wise, the default verifier's scheme) runs steps of up to 32
    rows (decode, verify, a few sequences) with every layer in one parallel region (csrc/layers/packed_w8a8_step.cpp), and
    the lm_head there too when it is packed W8A8: the bitwise comparisons here cover that path (the prefill of 20
    rows too). Longer prefills and the other kinds (per-channel W8A8 included) keep one parallel region per kernel."""
    fused = make(kind, "", model_dir).model.layers.fused
    assert [fused.one_region(rows) for rows in (1, 5, 32, 33)] == [kind.startswith("w8a8-g32")] * 3 + [False]


@pytest.mark.parametrize("kind", ["w8a8", "bf16", "bf16-inputs", "fp32"])
def test_fused_path_is_close_to_the_float_path(kind, model_dir):
    from quasar.model.loading import load

    reference = steps(load(model_dir, "fp32").model, None)  # plain torch
    got = steps(make(kind, "", model_dir), True)
    for ours, ref in zip(got, reference):
        assert (ours - ref).abs().max() < (0.05 if kind == "w8a8" else 0.02) * ref.abs().max()


def test_bf16_mlp_pieces_of_a_long_prefill_equal_the_unfused_kernels(tmp_path, tokenizer_dir):
    """A bf16 MLP takes silu(gate) * up and its rounding in pieces of rows (16 rows here, on both threads): the same
    logits as the modules one by one, and as the same tokens prefilled in two parts."""
    directory = write_hf_dir(tiny_hf_model("llama", seed=5, intermediate_size=4096), tmp_path, tokenizer_dir)
    model = make("bf16-inputs", "", directory)
    torch.manual_seed(2)
    ids = torch.randint(0, 1000, (1, 100))

    def prefill(fused: bool, parts: list[tuple[int, int]]) -> torch.Tensor:
        plan.prepare_(model, fuse=fused)
        cache = model.new_cache(128)
        with torch.inference_mode():
            return torch.cat([model(ids[:, a:b], cache)[0] for a, b in parts])

    whole = prefill(True, [(0, 100)])
    assert torch.equal(whole, prefill(False, [(0, 100)]))
    assert torch.equal(whole, prefill(True, [(0, 37), (37, 100)]))


def alone_and_in_a_verify_block(model) -> tuple[torch.Tensor, torch.Tensor]:
    """After a prefill of 20 tokens: the logits [6, V] of 6 more tokens scored one by one, and scored in one block."""
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (1, 26))
    plain, verify = model.new_cache(64), model.new_cache(64)
    with torch.inference_mode():
        model(ids[:, :20], plain)
        model(ids[:, :20], verify)
        alone = torch.cat([model(ids[:, i : i + 1], plain)[0] for i in range(20, 26)])
        return alone, model(ids[:, 20:26], verify)[0]


@pytest.mark.parametrize("kind", ["w8a8", "w8a8-g32-head", "bf16", "bf16-inputs", "fp32"])
def test_token_alone_equals_token_in_verify_block(kind, model_dir):
    alone, together = alone_and_in_a_verify_block(make(kind, "", model_dir))
    assert torch.equal(alone, together)


@pytest.mark.parametrize("D,H,H_kv", [(64, 9, 3), (128, 12, 2), (72, 6, 2), (8, 4, 4)])
def test_attention_rows_are_independent_of_the_rows_attended_with_them(D, H, H_kv):
    """The kernel attends the rows of a kv head together, key block by key block (blocks of 4096 / D keys):
    a verify block of 8 tokens over ~300 cached keys must give each token the output it gets alone."""
    torch.manual_seed(D)
    T, start, S = 8, 300, 320
    q, k, v = torch.randn(T, H * D), torch.randn(T, H_kv * D), torch.randn(T, H_kv * D)
    cos, sin = torch.randn(T, D), torch.randn(T, D)
    cache = torch.randn(2, H_kv, S, D)
    kernel = native.kernel()
    k_together, v_together = cache[0].clone(), cache[1].clone()
    together = kernel.decode_attention(q, k, v, cos, sin, k_together, v_together, start)  # [T, H * D]
    k_alone, v_alone = cache[0].clone(), cache[1].clone()
    alone = torch.cat([kernel.decode_attention(q[t : t + 1], k[t : t + 1], v[t : t + 1], cos[t : t + 1], sin[t : t + 1],
                                               k_alone, v_alone, start + t) for t in range(T)])
    assert torch.equal(together, alone)
    assert torch.equal(k_together, k_alone) and torch.equal(v_together, v_alone)


@pytest.mark.parametrize("D,H,H_kv,T,start", [(64, 9, 3, 37, 300), (128, 12, 2, 5, 40), (64, 4, 4, 1, 0), (128, 2, 1, 70, 0)])
def test_attention_is_the_same_on_every_float_path(D, H, H_kv, T, start):
    """With AVX-512 the kernel holds two rows' partial sums per register and 16 dims of the values: the same
    floats as AVX2, for prefills (rows with different key counts, odd row counts) and decode steps alike."""
    torch.manual_seed(T + D)
    q, k, v = torch.randn(T, H * D), torch.randn(T, H_kv * D), torch.randn(T, H_kv * D)
    cos, sin = torch.randn(T, D), torch.randn(T, D)
    cache = torch.randn(2, H_kv, start + T + 3, D)
    kernel = native.kernel()
    if len(kernel.float_paths()) < 2:
        pytest.skip(f"this CPU runs one float path ({kernel.float_paths()[0]}): nothing to compare")
    outs = []
    try:
        for path in kernel.float_paths():
            kernel.use_float_path(path)
            k_cache, v_cache = cache[0].clone(), cache[1].clone()
            outs.append(kernel.decode_attention(q, k, v, cos, sin, k_cache, v_cache, start))
    finally:
        kernel.use_float_path("auto")
    assert all(torch.equal(out, outs[0]) for out in outs)


def attention_inputs(D: int, H: int, H_kv: int, T: int, start: int):
    torch.manual_seed(D + T)
    cache = torch.randn(2, H_kv, start + T + 40, D)  # keys past the step's own: stale values a step must not read
    return [torch.randn(T, H * D), torch.randn(T, H_kv * D), torch.randn(T, H_kv * D), torch.randn(T, D),
            torch.randn(T, D)], cache


@pytest.mark.parametrize("D,H,H_kv", [(64, 9, 3), (128, 12, 2)])
def test_bf16_attention_on_amx_is_row_by_row_and_close_to_float32(D, H, H_kv):
    """The bf16 verifier's attention on AMX tiles (csrc/attention/attention_amx.cpp): a row gets the same floats alone, in a
    verify block and in any piece of a prefill (rows over 0 .. 100 keys, 70 rows: tiles of 16 and 32 rows, whole and
    not), and stays close to the float32 attention (bf16 q, k, v and weights: about 5e-3 relative)."""
    kernel = native.kernel()
    if not kernel.bf16_attention(True, D):
        pytest.skip(f"attention runs on bf16 products only on the amx float path (here: {kernel.float_path_for(True)})")
    (q, k, v, cos, sin), cache = attention_inputs(D, H, H_kv, 70, 30)

    def attend(t0: int, t1: int, caches, bf16: bool = True) -> torch.Tensor:
        rows = [x[t0:t1].contiguous() for x in (q, k, v, cos, sin)]
        return kernel.decode_attention(*rows, caches[0], caches[1], 30 + t0, bf16)

    whole = attend(0, 70, cache.clone())
    for parts in ([(0, 37), (37, 70)], [(0, 1), (1, 17), (17, 70)], [(t, t + 1) for t in range(70)]):
        pieces = cache.clone()
        assert torch.equal(torch.cat([attend(a, b, pieces) for a, b in parts]), whole), parts
    float32 = attend(0, 70, cache.clone(), bf16=False)
    assert not torch.equal(whole, float32)
    assert (whole - float32).norm() < 0.02 * float32.norm()


def test_bf16_attention_runs_for_bf16_inputs_on_the_amx_path_only():
    """kernel.bf16_attention decides for every forward: bf16 inputs, the amx float path, head_dim % 64 == 0. Anywhere
    else decode_attention's bf16_products changes nothing: the float32 attention's floats."""
    kernel = native.kernel()
    (q, k, v, cos, sin), cache = attention_inputs(64, 4, 2, 5, 20)
    try:
        for path in kernel.float_paths():
            kernel.use_float_path(path)
            assert kernel.bf16_attention(True, 64) == kernel.bf16_attention(True, 128) == (path == "amx")
            assert not kernel.bf16_attention(False, 64) and not kernel.bf16_attention(True, 72)
            if path != "amx":
                outs = [kernel.decode_attention(q, k, v, cos, sin, *cache.clone(), 20, bf16) for bf16 in (False, True)]
                assert torch.equal(outs[0], outs[1])
    finally:
        kernel.use_float_path("auto")


@pytest.fixture(scope="module")
def wide_heads_dir(tmp_path_factory, tokenizer_dir):
    """head_dim 64, as the default model's: the bf16 attention's tiles run (they take head_dim % 64 == 0)."""
    model = tiny_hf_model("llama", seed=7, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    return write_hf_dir(model, tmp_path_factory.mktemp("wide"), tokenizer_dir)


def test_a_bf16_verifier_with_bf16_attention_keeps_every_row_independent(wide_heads_dir):
    """Where the bf16 verifier's attention runs on AMX (its backend then says bf16-attention): fused and unfused
    forwards agree bitwise, a token gets the same logits alone and in a verify block, and the logits stay close to
    the float32 model's."""
    from quasar.model.loading import load

    model = make("bf16-inputs", "", wide_heads_dir)
    amx = native.kernel().bf16_attention(True, 64)
    assert model.plan.paths.endswith("+bf16-attention") == amx
    assert all(layer.self_attn.bf16_products for layer in model.model.layers)
    fused = steps(model, True)
    assert all(torch.equal(a, b) for a, b in zip(fused, steps(model, False)))
    reference = steps(load(wide_heads_dir, "fp32").model, None)
    for ours, ref in zip(fused, reference):
        assert (ours - ref).abs().max() < 0.02 * ref.abs().max()
    plan.prepare_(model)
    alone, together = alone_and_in_a_verify_block(model)
    assert torch.equal(alone, together)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory, tokenizer_dir):
    return write_hf_dir(tiny_hf_model("llama", seed=5, tie_word_embeddings=True), tmp_path_factory.mktemp("tied"),
                        tokenizer_dir)


@pytest.mark.parametrize("kind,layout", [("fp32", (3, torch.float32)), ("bf16", (3, torch.bfloat16)),
                                         ("bf16-inputs", (4, torch.bfloat16)), ("w8a8", (3, torch.float32))])
def test_one_call_forward_equals_the_modules_one_by_one(kind, layout, tied_dir):
    """A kernel model runs a whole forward in one call (embedding lookup, rope rows, layers, final norm, lm_head):
    bitwise the logits of the modules called one by one, prefill, verify and decode alike, for the layouts a tied
    embedding table takes when it shares the lm_head's packed panels (the plain tables of untied models: above)."""
    from quasar.model.loading import load

    model = load(tied_dir, "fp32").model
    if kind.startswith("bf16"):
        use_bf16_linears_(model, bf16_inputs=kind == "bf16-inputs")
    elif kind == "w8a8":
        quantize_(model, W8A8Config())
    plan.prepare_(model, owned=True)
    table = model.model.embed_tokens.weight
    assert (table.dim(), table.dtype) == layout, "the layout this case is for"
    whole = steps(model, True)
    assert model.plan.fused
    one_by_one = steps(model, False)
    assert not model.plan.fused
    for a, b in zip(whole, one_by_one):
        assert torch.equal(a, b)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_the_mlp_activation_is_row_by_row_at_any_thread_count(model_type, tmp_path, tokenizer_dir):
    """ATen's silu and gelu split a whole tensor between threads by its size and compute each part's tail one value at
    a time (other floats than its vector loop): over all rows at once, a row's values depended on how many rows came
    with it. 2,048 hidden units, 1-10 one-token sequences in one step at 3, 5 and 12 threads: each gets its logits
    alone."""
    from quasar.model.loading import load

    hf = tiny_hf_model(model_type, seed=5, intermediate_size=2048)
    model = load(write_hf_dir(hf, tmp_path / model_type, tokenizer_dir), "fp32").model
    assert plan.prepare_(model).fused
    threads = torch.get_num_threads()
    try:
        for n in (3, 5, 12):
            torch.set_num_threads(n)
            for rows in (1, 9, 10):
                caches = [model.new_cache(16) for _ in range(rows)]
                with torch.inference_mode():
                    together = model.forward_steps([Tokens([7 + i], c) for i, c in enumerate(caches)])
                    alone = [model.forward_steps([Tokens([7 + i], model.new_cache(16))])[0] for i in range(rows)]
                assert all(torch.equal(a, b) for a, b in zip(together, alone)), (n, rows)
    finally:
        torch.set_num_threads(threads)
