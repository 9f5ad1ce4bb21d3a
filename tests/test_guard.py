"""--guard MARGIN: W8A8 verifies, and positions where its top-1 logit leads by less than MARGIN take the float
model's token, scored over the request's (W8A8-written) cache. MARGIN 0 is plain ngram+w8a8; an infinite MARGIN
re-scores every step's first position: the float model decoding over W8A8's prompt cache."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from helpers import default_source, engine_for
from quasar.spec import EngineSpec, parse_levels
from quasar.decoding.confidence_guard import fold_value_scales_, guard_model, value_scales
from quasar.model.llama import FIXED_ROWS
from quasar.decoding.sampling import SamplingParams
from test_speculative import PROMPTS

PARAMS = SamplingParams(max_new_tokens=24)


@torch.inference_mode()
def float_over_w8a8_prompt(w8a8, float_, ids: list[int], n: int) -> list[int]:
    """n greedy tokens: the first from W8A8's prefill of the prompt, the others from the float model decoding
    one token at a time over that cache."""
    cache = w8a8.new_cache(len(ids) + n + FIXED_ROWS)
    out = [int(w8a8(torch.tensor([ids]), cache, last_only=True)[0, -1].argmax())]
    while len(out) < n:
        out.append(int(float_(torch.tensor([out[-1:]]), cache)[0, -1].argmax()))
    return out


@pytest.fixture(scope="module")
def answers():
    plain = engine_for("ngram+w8a8", k=5)
    prompts = [plain.encode(p) for p in PROMPTS]
    n = PARAMS.max_new_tokens
    guard = guard_model(default_source(), plain.target)
    return prompts, guard, [plain.generate(ids, PARAMS).token_ids for ids in prompts], [
        float_over_w8a8_prompt(plain.target.model, guard, ids, n) for ids in prompts]


def test_margin_zero_is_plain_w8a8_and_infinity_is_the_float_model_over_its_cache(answers):
    prompts, _, w8a8, float_ = answers
    for margin, expected in ((0.0, w8a8), (math.inf, float_)):
        engine = engine_for("ngram+w8a8", k=5, guard=margin)
        for ids, want in zip(prompts, expected):
            got = engine.generate(ids, PARAMS)
            assert got.token_ids == want[: len(got.token_ids)]
            assert got.stats.rechecked_tokens == (0 if margin == 0 else got.stats.verify_steps)


def test_a_finite_margin_rechecks_some_positions(answers):
    prompts, _, w8a8, _ = answers
    engine = engine_for("ngram+w8a8", k=5, guard=2.0)
    stats = [engine.generate(ids, PARAMS).stats for ids in prompts]
    assert 0 < sum(s.rechecked_tokens for s in stats) < sum(s.verify_steps for s in stats)


@pytest.mark.parametrize("verifier,drafter,match", [("bf16", "ngram", "bf16 is not one"), ("w4a8", "ngram", "w4a8 is not one"),
                                                   ("w8a8", "none", "needs a drafter")])
def test_guard_refuses_what_it_cannot_guard(verifier, drafter, match):
    with pytest.raises(ValueError, match=match):
        EngineSpec(parse_levels(verifier), drafter, guard=1.0)


def test_value_scales_come_back_from_a_quantized_o_proj_and_folding_them_keeps_the_function():
    from quasar.quant.int8 import Int8Linear, dequantize

    torch.manual_seed(0)
    n_kv, heads, head_dim, hidden = 2, 4, 16, 512  # 512 output channels average the int8 rounding out
    truth = torch.rand(n_kv * head_dim) * 3 + 0.5  # [H_kv * D]
    columns = truth.view(n_kv, 1, head_dim).expand(-1, heads // n_kv, -1).reshape(-1)  # [H * D]
    float_o = torch.randn(hidden, heads * head_dim)
    for group_size in (0, 32):
        smoothed = torch.nn.Linear(heads * head_dim, hidden, bias=False)
        smoothed.weight.data = float_o * columns[None, :]
        quantized = Int8Linear.from_float(smoothed, group_size=group_size)
        w = dequantize(quantized.weight, quantized.weight_scale)
        assert torch.allclose(value_scales(w, float_o, n_kv, head_dim), truth, rtol=3e-3)

    attention = torch.nn.Module()
    attention.n_kv, attention.head_dim = n_kv, head_dim
    attention.v_proj = torch.nn.Linear(hidden, n_kv * head_dim, bias=True)
    attention.o_proj = torch.nn.Linear(heads * head_dim, hidden, bias=False)
    x = torch.randn(5, hidden)
    probs = torch.softmax(torch.randn(heads, 5), -1)  # any attention weights
    def out(att):  # values mixed per query head (its kv head's values), then o_proj
        v = att.v_proj(x).view(5, n_kv, head_dim).repeat_interleave(heads // n_kv, 1)  # [5, H, D]
        return att.o_proj(torch.einsum("ht,thd->hd", probs, v).reshape(-1))
    before = out(attention)
    with torch.no_grad():
        fold_value_scales_(attention, truth)
    assert torch.allclose(out(attention), before, rtol=1e-4, atol=1e-5)


@torch.inference_mode()
def test_the_guard_model_is_the_float_model_with_the_verifiers_value_basis(answers):
    from quasar.verifiers.registry import load_verifier

    prompts, guard, _, _ = answers
    float_ = load_verifier(default_source(), "bf16").model
    ids = torch.tensor([prompts[0]])
    folded, plain = (m(ids, m.new_cache(len(prompts[0]) + FIXED_ROWS))[0] for m in (guard, float_))
    assert float((folded - plain).norm() / plain.norm()) < 0.02  # bf16 rounding of the folded v/o weights
    assert (folded.argmax(-1) == plain.argmax(-1)).float().mean() > 0.9


def test_a_rescored_position_keeps_the_requests_rules(answers):
    """The float model's re-score goes through the request's row processors as the verifier's rows do: the token
    the float model picks at the first re-scored position, banned by logit_bias, is not emitted there."""
    prompts, _, _, float_ = answers
    banned = float_[0][1]  # the first token comes from the prefill, the second from a re-score
    assert float_[0][0] != banned
    engine = engine_for("ngram+w8a8", k=5, guard=math.inf)
    got = engine.generate(prompts[0], dataclasses.replace(PARAMS, logit_bias={banned: -100.0}))
    assert got.token_ids[0] == float_[0][0] and banned not in got.token_ids and got.stats.rechecked_tokens > 0


def test_the_margin_is_that_of_the_rows_after_the_requests_rules(answers):
    """A token that logit_bias lifts far above the rest makes every position sure: nothing is re-scored, although
    the verifier's own rows leave some positions unsure at this margin (test_a_finite_margin_rechecks_some_positions)."""
    prompts, _, w8a8, _ = answers
    engine = engine_for("ngram+w8a8", k=5, guard=2.0)
    lifted = w8a8[0][0]
    got = engine.generate(prompts[0], dataclasses.replace(PARAMS, logit_bias={lifted: 100.0}))
    assert set(got.token_ids) == {lifted} and got.stats.rechecked_tokens == 0
