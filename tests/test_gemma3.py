"""Gemma 3 (sliding-window attention, sandwich norms, GeGLU, (1 + w) norms) through the engine on a tiny random
model whose window (8) every prompt here outgrows: greedy speculative decoding gives plain decoding's tokens,
batched requests their answers alone, in fp32 and W8A8 (linears on quasar's kernels where they run)."""

from __future__ import annotations

import pytest
from conftest import needs_kernels, tiny_hf_model, write_hf_dir
from helpers import decoder_for

from quasar.decoding.batch import Batch
from quasar.decoding.engine import Engine
from quasar.decoding.sampling import SamplingParams

TEXTS = ["def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 2, "The capital of France is Paris. " * 3,
         "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "Once upon a time there was a cat who lived in a tall tower."]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, tokenizer_dir):
    return write_hf_dir(tiny_hf_model("gemma3_text"), tmp_path_factory.mktemp("tiny-gemma3"), tokenizer_dir)


@pytest.fixture(scope="module", params=["fp32", "w8a8"])
def target(request, gemma_dir, tmp_path_factory):
    from quasar import files
    from quasar.verifiers.registry import load_verifier

    cache = tmp_path_factory.mktemp("cache")
    old, files._cache_dir = files._cache_dir, cache
    try:
        return load_verifier(gemma_dir, request.param)
    finally:
        files._cache_dir = old


def test_gemma_runs_fused_on_the_kernels(target):
    """Where the kernels run, the whole forward is one kernel call (the fused layers: sandwich norms, GeGLU, the
    sliding windows), with every linear in the verifier's format."""
    from quasar.kernels import native

    plan = target.model.plan
    assert plan.paths.startswith("kernels:") == plan.fused == (native.kernel() is not None)
    assert target.model.config.sliding_layers == (True, False, True)
    kinds = {type(m).__name__ for name, m in target.model.named_modules() if name.endswith(("_proj", "lm_head"))}
    assert len(kinds) == 1 and kinds <= {"Linear", "KernelLinear", "Int8Linear", "KernelInt8Linear"}, kinds


def test_greedy_speculative_equals_greedy_plain(target):
    plain, spec = Engine(target), Engine(target, decoder_for("ngram", target, k=4))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for text in TEXTS:
        ids = plain.encode(text, chat=False)
        assert len(ids) > 8
        want, got = plain.generate(ids, params), spec.generate(ids, params)
        assert got.token_ids == want.token_ids
    assert got.stats.verify_steps < len(got.token_ids)  # drafts were accepted somewhere


def test_batched_answers_equal_answers_alone(target):
    engine = Engine(target, decoder_for("ngram", target, k=3))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 12, 25, 18)]
    ids = [engine.encode(t, chat=False) for t in TEXTS]
    alone = [engine.generate(i, p) for i, p in zip(ids, params)]
    requests = [engine.request(i, p) for i, p in zip(ids, params)]
    Batch(engine, max_batch=3, max_rows=4).run_all(requests)
    assert [r.output.token_ids for r in requests] == [a.token_ids for a in alone]


@needs_kernels
@pytest.mark.parametrize("scheme", ["fp32", "bf16"])
def test_the_fused_kernels_give_the_torch_modules_logits_past_the_window(gemma_dir, scheme):
    """A prefill of 20 tokens (window 8), a verify block of 5 and two decode steps: the fused forward (sandwich norms,
    GeGLU, (1 + w) norms, the scale 1 / sqrt(query_pre_attn_scalar), windows with their own RoPE base) stays close to
    the same model's torch modules; without its windows it would not (the window matters here)."""
    import torch

    from quasar.kernels import plan
    from quasar.model.loading import load
    from quasar.quant.bf16 import use_bf16_linears_

    def steps(model, window: bool = True):
        if not window:
            for layer in model.model.layers:
                layer.self_attn.window = None
        if model.plan.fused:
            plan.prepare_(model)  # rebuilt with the windows as they are now
        torch.manual_seed(0)
        ids = torch.randint(0, 1000, (1, 27))
        cache = model.new_cache(64)
        with torch.inference_mode():
            return torch.cat([model(ids[:, a:b], cache)[0] for a, b in ((0, 20), (20, 25), (25, 26), (26, 27))])

    def model():
        m = load(gemma_dir, "fp32").model
        if scheme == "bf16":
            use_bf16_linears_(m)
        return m

    reference = steps(model())
    fused = model()
    assert plan.prepare_(fused).fused
    got = steps(fused)
    tolerance = 1e-4 if scheme == "fp32" else 3e-2
    assert (got - reference).abs().max() < tolerance * reference.abs().max()
    assert (steps(fused, window=False) - reference).abs().max() > 10 * tolerance * reference.abs().max()


@pytest.fixture
def small_rings(monkeypatch):
    """Rings of 64 positions (steps of at most 4 tokens, window 8): every cache of 256 keeps its sliding layers in
    rings, and every prompt here is prefilled in pieces."""
    from quasar.model import gemma3

    monkeypatch.setattr(gemma3, "RING_ROWS", 4)


LONG_TEXT = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps on. " * 4


@pytest.fixture(params=["fp32-or-w8a8", "bf16"])
def any_target(request, target, gemma_dir, tmp_path, monkeypatch):
    """target, and the bf16 verifier (its attention on AMX tiles where the CPU has them)."""
    from quasar import files
    from quasar.verifiers.registry import load_verifier

    if request.param != "bf16":
        return target
    monkeypatch.setattr(files, "_cache_dir", tmp_path)
    return load_verifier(gemma_dir, "bf16")


@needs_kernels
def test_ring_caches_answer_as_whole_caches(any_target, small_rings, monkeypatch):
    """Greedy speculative decoding over 200 tokens (the rings wrap several times, verify steps are trimmed back in
    them) and a batch of requests give bitwise the tokens of caches that keep every position."""
    from quasar.model import gemma3

    target = any_target
    cache = target.model.new_cache(256)
    assert cache.ring == 64 and cache.max_rows == 4 and cache.k.shape[0] == 1 and cache.ring_k.shape[0] == 2
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (200, 40, 90)]

    def answers(rings: int):
        engine = Engine(target, decoder_for("ngram", target, k=3))  # a cache pool of its own
        ids = [engine.encode(t, chat=False) for t in (LONG_TEXT, TEXTS[0], TEXTS[1])]
        alone = [engine.generate(i, p).token_ids for i, p in zip(ids, params)]
        requests = [engine.request(i, p) for i, p in zip(ids, params)]
        Batch(engine, max_batch=3, max_rows=6).run_all(requests)
        assert {c.ring for c in engine.caches.free} == {rings}
        return alone, [r.output.token_ids for r in requests]

    ringed = answers(64)
    monkeypatch.setattr(gemma3, "RING_ROWS", 0)
    whole = answers(0)
    assert ringed == whole and ringed[0] == ringed[1]


@needs_kernels
def test_a_batch_mixes_caches_with_and_without_rings(target, monkeypatch):
    """Rings of 160 positions: a 512-position cache keeps them, a 256-position one does not; a batch of both runs a
    forward per layout and answers as each request alone. A layer-skip view of the model makes its own caches."""
    import torch

    from quasar.model import gemma3
    from quasar.verifiers.pruned import keep_layers

    monkeypatch.setattr(gemma3, "RING_ROWS", 100)
    engine = Engine(target, decoder_for("ngram", target, k=3))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (200, 40, 30)]
    ids = [engine.encode(t, chat=False) for t in (LONG_TEXT, TEXTS[0], TEXTS[1])]
    alone = [engine.generate(i, p).token_ids for i, p in zip(ids, params)]
    requests = [engine.request(i, p) for i, p in zip(ids, params)]
    Batch(engine, max_batch=3, max_rows=6).run_all(requests)
    assert [r.output.token_ids for r in requests] == alone
    assert {c.ring for c in engine.caches.free} == {0, 160}
    first = keep_layers(target.model, [0])  # a sliding layer: its view's cache keeps one ring
    cache = first.new_cache(512)
    assert cache.ring == 160 and cache.ring_k.shape[0] == 1 and cache.k.shape[0] == 0
    with torch.inference_mode():
        assert torch.isfinite(first(torch.arange(1, 300)[None], cache)).all()


@needs_kernels
def test_a_ring_refuses_what_it_no_longer_holds(target, small_rings):
    """A trim back past what the rings hold, or a prefix of such a cache, is refused (not read stale); a prefix the
    rings still hold (a chat's next turn) is taken."""
    import torch

    from quasar.model.kv_cache import CachePool

    model = target.model
    cache = model.new_cache(256)
    with torch.inference_mode():
        model(torch.arange(1, 101)[None], cache)
    assert cache.keeps(100 - 26) and not cache.keeps(100 - 27)  # R - window - 30 = 26 positions back
    with pytest.raises(ValueError, match="cannot trim"):
        cache.trim(27)
    cache.trim(26)
    pool = CachePool(model)
    taken = pool.take(256)
    with torch.inference_mode():
        model(torch.arange(1, 101)[None], taken)
    taken.held = list(range(1, 101))
    pool.give(taken)
    assert pool.longest_prefix(list(range(1, 101)) + [7, 8]) == (taken, 100)
    assert pool.longest_prefix(list(range(1, 50)) + [7, 8]) == (None, 0)  # its window is gone from the rings
    longer = pool.take(512, list(range(1, 101)) + [7, 8])  # a cache of another size takes the prefix over
    assert longer.length == 100 and longer.ring == 64
    pool.give(longer)
    pool.configure(None, 2)
    short = pool.take(64)  # too short for rings: a prefix of it cannot go into a cache with rings, nor back
    with torch.inference_mode():
        model(torch.arange(1, 31)[None], short)
    short.held = list(range(1, 31))
    pool.give(short)
    assert not short.ring and pool.take(512, list(range(1, 31)) + [9]).length == 0


def test_smoothing_folds_into_a_one_plus_w_norm():
    import torch

    from quasar.model.gemma3 import GemmaRMSNorm

    norm = GemmaRMSNorm(16, 1e-6)
    torch.nn.init.uniform_(norm.weight, -0.5, 0.5)
    x, s = torch.randn(3, 16), torch.rand(16) + 0.5
    want = norm(x) / s
    norm.divide_(s)
    assert torch.allclose(norm(x), want, rtol=1e-5, atol=1e-6)



# ---- the real Gemma 3 270M (after `quasar models install gemma3-270m`; not installed in CI) ------------------


def real_gemma():
    from quasar.files import ModelLoadError
    from quasar.tools.model_store import installed_model

    try:
        return installed_model("gemma3-270m")
    except ModelLoadError:
        pytest.skip("Gemma 3 270M is not installed (quasar models install gemma3-270m)")


LONG = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
        "metal type, oil-based inks and a wooden screw press into a system that could produce books quickly. ") * 18


@pytest.fixture(scope="module")
def real_pair():
    """quasar's fp32 model and transformers' Gemma3ForCausalLM, both from the installed Q4_K_M GGUF."""
    import torch
    from transformers import AutoModelForCausalLM

    from quasar.model.loading import load

    path = real_gemma()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return load(path, "fp32"), hf


@pytest.mark.parametrize("prompt", ["The capital of France is", "def fibonacci(n):\n", LONG])
def test_real_gemma_fp32_greedy_equals_transformers(real_pair, prompt):
    """64 greedy tokens from the Q4_K_M GGUF, dequantized to fp32, equal transformers' on the same file, on the torch
    modules and on the fused kernels; the last prompt (over 600 tokens) is longer than the sliding window (512)."""
    import copy

    import torch

    from quasar.kernels import plan

    ours, hf = real_pair
    ids = ours.tokenizer(prompt, return_tensors="pt").input_ids
    assert prompt != LONG or ids.shape[1] > ours.model.config.sliding_window
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=64, do_sample=False, min_new_tokens=64)[0, ids.shape[1]:].tolist()
    fused = copy.copy(ours)
    fused.model = copy.deepcopy(ours.model)
    assert plan.prepare_(fused.model).fused == (plan.kernel_for(fused.model) is not None)
    for loaded in (ours, fused):
        got = Engine(loaded).generate(ids[0].tolist(), SamplingParams(max_new_tokens=64, ignore_eos=True)).token_ids
        assert got == want, loaded.model.plan.paths


@pytest.mark.parametrize("verifier", ["w8a8", "w4a8", "bf16"])
def test_real_gemma_greedy_speculative_equals_plain_past_the_window(verifier, monkeypatch):
    """On the fused kernels, W8A8, the file's own blocks and bf16 (its attention on AMX tiles where the CPU has them,
    head_dim 256): n-gram drafts change nothing over 600 tokens of prompt (longer than the 512-token window), and
    caches whose sliding layers keep rings (prefilled 16 tokens at a time, 600 new tokens: they wrap) answer as
    caches that keep every position."""
    from quasar.model import gemma3
    from quasar.verifiers.registry import load_verifier

    path = real_gemma()
    target = load_verifier(path, verifier)
    plain, spec = Engine(target), Engine(target, decoder_for("ngram", target, k=5))
    ids = plain.encode(LONG, chat=False)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    want, got = plain.generate(ids, params), spec.generate(ids, params)
    assert got.token_ids == want.token_ids and got.stats.verify_steps < 40
    long = SamplingParams(max_new_tokens=600, ignore_eos=True)
    whole = Engine(target, decoder_for("ngram", target, k=5)).generate(ids, long)
    monkeypatch.setattr(gemma3, "RING_ROWS", 16)
    ringed = Engine(target, decoder_for("ngram", target, k=5))
    assert ringed.generate(ids, long).token_ids == whole.token_ids
    assert {c.ring for c in ringed.caches.free} == {576}


def test_the_exact_cascade_answers_as_its_top_verifier(gemma_dir, tmp_path, monkeypatch):
    """ngram+w8a8+bf16: W8A8 verifies the n-gram drafts, bf16 the W8A8 output; greedy tokens are bf16's alone."""
    from quasar import files
    from quasar.builder import Verifiers, build_engine
    from quasar.spec import EngineSpec

    monkeypatch.setattr(files, "_cache_dir", tmp_path / "cache")
    verifiers = Verifiers(gemma_dir)
    cascade = build_engine(EngineSpec.parse("ngram+w8a8+bf16", k=4), verifiers)
    top = build_engine(EngineSpec.parse("ar:bf16"), verifiers)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for text in TEXTS[:2]:
        ids = top.encode(text, chat=False)
        assert cascade.generate(ids, params).token_ids == top.generate(ids, params).token_ids
