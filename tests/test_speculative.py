"""The speculative loop: lossless sampling (statistical), KV cache after rollbacks, stop rules, stats."""

from __future__ import annotations

import pytest
import torch

from quasar.decoding.drafters import build_drafter
from quasar.model.llama import FIXED_ROWS
from quasar.decoding.drafters.model_drafter import ModelDrafter
from quasar.decoding.engine import Engine
from quasar.decoding.drafters.ngram import NgramDrafter
from conftest import needs_kernels
from helpers import default_source, drive, engine_for
from quasar.decoding.autoregressive import StopRule
from quasar.model.config import ModelConfig
from quasar.model.llama import Transformer
from quasar.decoding.sampling import SamplingParams, logits_to_probs
from quasar.decoding.autoregressive import autoregressive
from quasar.decoding.costs import StepCosts
from quasar.decoding.speculative import AUTO, DraftLength, Speculative
from quasar.spec import parse_k
from quasar.decoding.stats import GenerationStats
from test_verify import chi_square_p

V = 8  # a small vocabulary so the distribution of whole token sequences can be computed exactly
PROMPT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]


@pytest.fixture
def one_thread():
    """Tiny models run many small ops: one thread avoids thread-sync overhead on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_model(seed: int, sharpness: float = 4.0, vocab: int = V) -> Transformer:
    """A random 2-layer llama over V tokens; lm_head scaled so distributions are peaked but not one-hot."""
    config = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


def run(model, decoder, prompt, params, budget, cache_len=64):
    """Run a decoder to the end; return (emitted tokens, cache, stats)."""
    cache, stats = model.new_cache(cache_len), GenerationStats()
    steps = decoder(model, cache, prompt, params, StopRule(params, (V - 1,), budget), stats)
    out = [t for tokens in drive(model, steps) for t in tokens]
    return out, cache, stats


@torch.inference_mode()
def exact_joint(model: Transformer, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] under the model with `params`, by enumerating all prefixes."""
    first = logits_to_probs(model(torch.tensor([prompt]), model.new_cache(32))[0, -1], params)  # [V]
    pairs = torch.tensor([[*prompt, a] for a in range(V)])  # [V, P+1]
    second = logits_to_probs(model(pairs, model.new_cache(32, V))[:, -1], params)  # [V, V]
    triples = torch.tensor([[*prompt, a, b] for a in range(V) for b in range(V)])  # [V*V, P+2]
    third = logits_to_probs(model(triples, model.new_cache(32, V * V))[:, -1], params).view(V, V, V)
    return first[:, None, None] * second[:, :, None] * third


DRAFTERS = {
    "model": lambda: ModelDrafter(small_model(seed=1, sharpness=3.0), V),  # real draft probabilities
    "ngram": lambda: NgramDrafter(1, 3),  # deterministic, matches often on the repetitive prompt
}
SETTINGS = {"T=1": SamplingParams(temperature=1.0), "T=0.7,top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9)}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_sampling_is_lossless(drafter, setting, one_thread):
    """The first three emitted tokens of speculative decoding (k=2: two of them pass rejection sampling)
    follow the verifier's own joint distribution (a wrong acceptance or residual rule fails this)."""
    model, n = small_model(seed=0), 800
    base = SETTINGS[setting]
    decoder = Speculative(DRAFTERS[drafter](), k=2)
    counts, proposed = torch.zeros(V, V, V), 0
    for seed in range(n):
        params = SamplingParams(temperature=base.temperature, top_p=base.top_p, seed=seed, max_new_tokens=3, ignore_eos=True)
        tokens, _, stats = run(model, decoder, PROMPT, params, budget=4)
        counts[tuple(tokens[:3])] += 1
        proposed += stats.proposed_tokens
    joint = exact_joint(model, PROMPT, base)
    assert proposed > n  # drafts were really proposed and verified
    assert chi_square_p(counts.flatten(), joint.flatten()) > 1e-3
    assert chi_square_p(counts.sum((0, 1)), joint.sum((0, 1))) > 1e-3  # the third token alone


def test_cache_after_many_rollbacks_equals_fresh_prefill():
    model = small_model(seed=0)
    params = SamplingParams(temperature=1.0, seed=7, ignore_eos=True, max_new_tokens=60)
    tokens, cache, stats = run(model, Speculative(ModelDrafter(small_model(seed=1, sharpness=3.0), V), k=4), PROMPT,
                               params, budget=60, cache_len=128)
    assert len(tokens) == 60 and stats.verify_steps > 10
    assert stats.accepted_tokens < stats.proposed_tokens  # rejections (rollbacks) happened
    assert stats.accepted_tokens > 0
    seen = PROMPT + tokens[:-1]  # the last emitted token is not yet in the cache
    assert cache.length == len(seen)
    fresh = model.new_cache(128)
    with torch.inference_mode():
        model(torch.tensor([seen]), fresh)
    torch.testing.assert_close(cache.k[:, :, :, : len(seen)], fresh.k[:, :, :, : len(seen)], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :, : len(seen)], fresh.v[:, :, :, : len(seen)], rtol=1e-4, atol=1e-5)


def test_stops_at_eos_and_budget_inside_a_step():
    """A draft that runs past EOS or the budget is cut, and the stats count only emitted tokens."""
    model = small_model(seed=0)
    draft_all = Speculative(ModelDrafter(model, V), k=6)  # the verifier drafting for itself: all accepted
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    tokens, _, stats = run(model, draft_all, PROMPT, params, budget=5)
    assert len(tokens) == 5 and stats.finish_reason == "length"
    assert sum(stats.accept_lengths) + 1 == 5  # the first token comes from the prefill
    free, _, _ = run(model, draft_all, PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True), budget=40)
    eos = free[7]
    stop = StopRule(SamplingParams(max_new_tokens=40), (eos,), 40)
    cache, stats = model.new_cache(64), GenerationStats()
    out = [t for step in drive(model, draft_all(model, cache, PROMPT, SamplingParams(), stop, stats)) for t in step]
    assert out == free[: free.index(eos) + 1] and stats.finish_reason == "stop"


def test_draft_never_runs_past_the_cache():
    model = small_model(seed=0)
    tokens, cache, _ = run(model, Speculative(ModelDrafter(model, V), k=7), PROMPT,
                           SamplingParams(max_new_tokens=40, ignore_eos=True), budget=40, cache_len=len(PROMPT) + 41)
    assert len(tokens) == 40 and cache.length <= cache.max_len


def costs(a: float, b: float) -> StepCosts:
    """Step costs measured on steps of a + b * rows seconds."""
    model = StepCosts()
    for rows in [1, 2, 4, 6, 8] * 4:
        model.add(rows, a + b * rows)
    return model


def test_adaptive_draft_length():
    length = DraftLength(parse_k("auto"))
    assert length.k == DraftLength.K_START
    for _ in range(10):
        length.update(proposed=length.k, accepted=length.k)
    assert length.k == DraftLength.K_MAX
    length = DraftLength(AUTO, costs(1.0, 0.5))
    for _ in range(10):
        length.update(proposed=length.k, accepted=0)
    assert length.k == 1  # k_min: a drafter that costs something keeps drafting one
    length.update(proposed=0, accepted=0)  # no draft: no evidence, k unchanged
    assert length.k == 1
    assert DraftLength(3).k == 3
    with pytest.raises(ValueError):
        parse_k("0")


def test_draft_length_follows_what_rows_cost():
    """The same acceptance (1 in 3 at every position) drafts where an extra row is cheap (AVX-512 VNNI: a 6-row step
    about 1.1 one-row steps) and not where it is dear (AVX2: about 3)."""
    lengths = {}
    for name, b in {"cheap rows": 0.02, "dear rows": 0.5}.items():
        length = DraftLength(AUTO, costs(1.0, b), k_min=0)
        for _ in range(30):
            length.update(proposed=max(length.k, 1), accepted=0)
            length.update(proposed=3, accepted=3)
            length.update(proposed=3, accepted=0)
        lengths[name] = length.best()
    assert lengths["cheap rows"] >= 2 and lengths["dear rows"] == 0


def test_a_plain_step_watches_the_drafters_guess():
    length = DraftLength(AUTO, costs(1.0, 0.5), k_min=0)
    for _ in range(20):
        length.update(proposed=1, accepted=0)
    assert length.k == 0
    for _ in range(20):
        length.guessed(True)
    assert length.k >= 1


@pytest.mark.parametrize("b", [0.02, 20.0])
def test_greedy_output_is_plain_whatever_the_draft_length(b, one_thread):
    """Steps that draft nothing (rows dear, drafts missed) and steps that draft give greedy decoding's tokens."""
    model = small_model(seed=0)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    decoder = Speculative(NgramDrafter(1, 3), k=AUTO)
    decoder.costs = costs(1.0, b)
    tokens, _, stats = run(model, decoder, PROMPT, params, budget=40)
    plain, _, _ = run(model, autoregressive, PROMPT, params, budget=40)
    assert tokens == plain
    drafted = stats.proposed_tokens / stats.verify_steps  # draft tokens a step
    assert drafted < 0.5 if b == 20.0 else drafted > 1


def test_a_draft_longer_than_the_exact_path_takes_is_refused():
    """k + 1 verify rows must fit FIXED_ROWS, or verify rows would take the prefill path and round differently."""
    assert parse_k(str(FIXED_ROWS - 1)) == FIXED_ROWS - 1
    with pytest.raises(ValueError, match="too long"):
        parse_k(str(FIXED_ROWS))


# ---- the real default model: greedy speculative == greedy autoregressive, token for token ---------------------

PROMPTS = (
    "What is 2+2?",  # a short answer: ends at EOS
    "Write a Python function that returns the square of a number.",  # ends at the token limit
    "Repeat after me: the quick brown fox jumps over the lazy dog. the quick brown fox",  # long n-gram matches
)
VERIFIERS = ("fp32", "w8a8", "w4a8")


@pytest.fixture(scope="module", params=VERIFIERS)
def verifier(request):
    from quasar.verifiers import registry as verifiers

    target = verifiers.load_verifier(default_source(), request.param)
    engine = Engine(target)
    prompts = [engine.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=32)
    return target, prompts, [engine.generate(ids, params) for ids in prompts]


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "model:TINY", "layerskip:8"])
def test_greedy_speculative_equals_greedy_autoregressive(verifier, drafter, tiny_model_dir):
    target, prompts, expected = verifier
    assert {e.finish_reason for e in expected} == {"stop", "length"}  # both endings are covered
    spec = drafter.replace("TINY", str(tiny_model_dir))
    engine = Engine(target, decoder=Speculative(build_drafter(spec, target), k=5))
    for ids, want in zip(prompts, expected):
        got = engine.generate(ids, SamplingParams(max_new_tokens=32))
        assert got.token_ids == want.token_ids
        assert got.finish_reason == want.finish_reason
        stats = got.stats
        assert stats.verify_steps == len(stats.accept_lengths) and sum(stats.accept_lengths) + 1 == len(got.token_ids)
        assert stats.verify_steps <= len(got.token_ids) - 1


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_greedy_tree_speculative_equals_greedy_autoregressive(verifier, drafter):
    """Draft trees (three candidates a position, every node scored in one forward) on real weights: plain decoding's
    tokens, on every verifier whose rows may be a tree."""
    target, prompts, expected = verifier
    engine = Engine(target, decoder=Speculative(build_drafter(drafter, target), k=5, width=3))
    steps = nodes = 0
    for ids, want in zip(prompts, expected):
        got = engine.generate(ids, SamplingParams(max_new_tokens=32))
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        steps, nodes = steps + got.stats.verify_steps, nodes + got.stats.proposed_tokens
    assert nodes > steps or not target.model.plan.tree_rows  # trees were scored where rows may be one


def test_forward_is_row_independent(tiny_model):
    """A token scored alone and inside a verify block gets bitwise the same logits (fixed_rows padding)."""
    model, ids = tiny_model.model, [1, 50, 60, 70, 80]
    cache = model.new_cache(64)
    with torch.inference_mode():
        model(torch.tensor([ids]), cache)
        block = model(torch.tensor([[5, 6, 7, 8, 9, 10]]), cache)[0]  # [6, V]
        cache.trim(6)
        for i, token in enumerate([5, 6, 7]):
            alone = model(torch.tensor([[token]]), cache)[0, 0]  # [V]
            assert torch.equal(alone, block[i])


@needs_kernels
@pytest.mark.parametrize("stop", ["brown", "lazy", "river"])
def test_a_stop_string_ends_the_output_at_the_token_that_completes_it(stop):
    """A verify step accepts a run of copied tokens at once (here 8); a stop string inside the run ends the output
    at the token that completes it: the tokens after it are neither returned nor counted."""
    engine = engine_for("ngram+w8a8", k=7)
    text = "The quick brown fox jumps over the lazy dog near the quiet river bank at dawn."
    prompt = engine.encode(f"Repeat this sentence exactly, once: {text}")
    out = engine.generate(prompt, SamplingParams(max_new_tokens=40, stop=(stop,)))
    assert out.stats.finish_reason == "stop" and stop not in out.text
    assert max(out.stats.accept_lengths) > 1  # a run was accepted at once
    assert stop in engine.tokenizer.decode(out.token_ids)  # the last token completes the stop string...
    assert stop not in engine.tokenizer.decode(out.token_ids[:-1])  # ...and no token comes after it
    assert out.stats.new_tokens == len(out.token_ids)


def test_a_seeded_sampled_request_drafts_alike_however_fast_rows_ran(one_thread):
    """A model drafter's sampled drafts draw random numbers: a seeded request's draft lengths follow its own tokens
    only, so it draws the same random numbers, alone or in any batch, on any machine."""
    model = small_model(seed=0)
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=30, ignore_eos=True)
    outputs = []
    for b in (0.02, 0.5):
        decoder = Speculative(DRAFTERS["model"](), k=AUTO)
        decoder.costs = costs(1.0, b)
        outputs.append(run(model, decoder, PROMPT, params, budget=30)[0])
    assert outputs[0] == outputs[1]


def test_step_costs_keep_each_sizes_own_time():
    """Kernels work in tiles of rows: 1 to 4 rows cost alike here, 5 to 8 twice that. A line through them would make
    a 2-row step dearer than it is; each size's own mean does not, and sizes never timed follow the line."""
    steps = StepCosts()
    for _ in range(5):
        for rows in (1, 2, 4, 6, 8):
            steps.add(rows, 1.0 if rows <= 4 else 2.0)
    assert steps.cost(2) == pytest.approx(1.0) and steps.cost(6) == pytest.approx(2.0)
    a, b = steps.fit()
    assert steps.cost(3) == pytest.approx(a + 3 * b)
    alone = StepCosts()
    alone.add(1, 0.03)  # no line yet: the prior's shape through the size seen
    assert alone.cost(5) == pytest.approx(0.03 * (1 + 5 * StepCosts.PRIOR) / (1 + StepCosts.PRIOR))
    assert StepCosts().cost(1) is None
