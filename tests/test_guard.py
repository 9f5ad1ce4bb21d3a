"""--guard MARGIN: W8A8 verifies, and positions where its top-1 logit leads by less than MARGIN take the float
model's token. MARGIN 0 is plain ngram+w8a8; an infinite MARGIN re-scores every step (the float model's output)."""

from __future__ import annotations

import math

import pytest

from quasar.api import DecodeConfig, build_engine
from quasar.sampling import SamplingParams
from test_speculative import PROMPTS

PARAMS = SamplingParams(max_new_tokens=24)


@pytest.fixture(scope="module")
def answers():
    plain = build_engine("default", "w8a8", DecodeConfig("ngram", k=5))
    float_ = build_engine("default", "bf16")
    prompts = [plain.encode(p) for p in PROMPTS]
    return prompts, [plain.generate(ids, PARAMS) for ids in prompts], [float_.generate(ids, PARAMS) for ids in prompts]


def test_margin_zero_is_plain_w8a8_and_infinity_is_the_float_model(answers):
    prompts, w8a8, float_ = answers
    for margin, expected in ((0.0, w8a8), (math.inf, float_)):
        engine = build_engine("default", "w8a8", DecodeConfig("ngram", k=5, guard=margin))
        for ids, want in zip(prompts, expected):
            got = engine.generate(ids, PARAMS)
            assert got.token_ids == want.token_ids
            assert got.stats.rechecked_tokens == (0 if margin == 0 else got.stats.verify_steps)


def test_a_finite_margin_rechecks_some_positions(answers):
    prompts, w8a8, _ = answers
    engine = build_engine("default", "w8a8", DecodeConfig("ngram", k=5, guard=2.0))
    stats = [engine.generate(ids, PARAMS).stats for ids in prompts]
    assert 0 < sum(s.rechecked_tokens for s in stats) < sum(s.verify_steps for s in stats)


@pytest.mark.parametrize("verifier,drafter,match", [("bf16", "ngram", "already float"), ("w8a8", "none", "needs a drafter")])
def test_guard_refuses_what_it_cannot_guard(verifier, drafter, match):
    with pytest.raises(ValueError, match=match):
        build_engine("default", verifier, DecodeConfig(drafter, guard=1.0))
