"""The cascade (MIDDLE+TOP, e.g. 'w8a8+bf16'): the output is the top verifier's, greedy token for token on the
real default model, and distributed as the top verifier's when sampling (two-level rejection sampling)."""

from __future__ import annotations

import pytest
import torch

from helpers import default_source, decoder_for, engine_for
from quasar.spec import parse_levels
from quasar.decoding.cascade import CascadeDrafter
from quasar.decoding.drafters.ngram import NgramDrafter
from quasar.decoding.engine import Engine
from quasar.decoding.sampling import SamplingParams
from quasar.decoding.speculative import Speculative
from test_speculative import PROMPT, PROMPTS, exact_joint, one_thread, run, small_model  # noqa: F401
from test_verify import chi_square_p


def test_cascade_names():
    assert [str(level) for level in parse_levels("w8a8+bf16")] == ["w8a8", "bf16"]
    assert [str(level) for level in parse_levels("bf16")] == ["bf16"]
    for bad in ("w8a8+", "+bf16", "w8a8+w8a16+bf16"):
        with pytest.raises(ValueError, match="MIDDLE\\+TOP"):
            parse_levels(bad)


@pytest.fixture(scope="module")
def float_answers():
    from quasar.verifiers.registry import load_verifier

    target, middle = load_verifier(default_source(), "bf16"), load_verifier(default_source(), "w8a8")
    engine = Engine(target)
    prompts = [engine.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=32)
    return target, middle, prompts, [engine.generate(ids, params) for ids in prompts]


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "none"])
def test_greedy_cascade_equals_the_float_verifier(float_answers, drafter):
    """w8a8+bf16 at T = 0 gives ar:bf16's tokens, whatever drafts the w8a8 level and whatever it gets wrong."""
    target, middle, prompts, expected = float_answers
    engine = Engine(target, decoder_for(drafter, target, k=5, middle=middle))
    for ids, want in zip(prompts, expected):
        got = engine.generate(ids, SamplingParams(max_new_tokens=32))
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        level = got.stats.to_dict()["middle"]
        assert level["verify_steps"] > 0 and (level["proposed_tokens"] > 0) == (drafter != "none")
        assert got.stats.verify_steps < len(got.token_ids) - 1  # the float level checks blocks, not single tokens


def test_the_files_own_blocks_draft_for_the_float_model(float_answers):
    """ngram+w4a8+bf16 (the --exact of a GGUF's own blocks): the float model's tokens."""
    from quasar.verifiers.registry import load_verifier

    target, _, prompts, expected = float_answers
    engine = Engine(target, decoder_for("ngram", target, k=5, middle=load_verifier(default_source(), "w4a8")))
    for ids, want in zip(prompts, expected):
        assert engine.generate(ids, SamplingParams(max_new_tokens=32)).token_ids == want.token_ids


def test_build_engine_takes_a_cascade_name():
    engine = engine_for("ngram+w8a8+bf16")
    assert isinstance(engine.decoder.drafter, CascadeDrafter) and engine.target.model.plan.paths.startswith(("kernels", "torch"))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_cascade_is_lossless(temperature, top_p, one_thread):
    """Tiny models: an n-gram drafter drafts for a middle model whose output drafts for the top model; the first
    three emitted tokens follow the top model's joint distribution."""
    top, middle, n = small_model(seed=0), small_model(seed=2, sharpness=3.0), 800
    decoder = Speculative(CascadeDrafter(middle, NgramDrafter(1, 3), k=2), k=2)
    counts, proposed = torch.zeros(8, 8, 8), 0
    for seed in range(n):
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_new_tokens=3, ignore_eos=True)
        tokens, _, stats = run(top, decoder, PROMPT, params, budget=4)
        counts[tuple(tokens[:3])] += 1
        proposed += stats.proposed_tokens
    joint = exact_joint(top, PROMPT, SamplingParams(temperature=temperature, top_p=top_p))
    assert proposed > n
    assert chi_square_p(counts.flatten(), joint.flatten()) > 1e-3
    assert chi_square_p(counts.sum((0, 1)), joint.sum((0, 1))) > 1e-3


def test_metrics_count_the_middle_level():
    from quasar.serve.metrics import Metrics
    from quasar.decoding.stats import GenerationStats

    stats, middle = GenerationStats(new_tokens=9), GenerationStats()
    middle.record_step(proposed=4, accepted=3, emitted=4)
    middle.record_step(proposed=2, accepted=0, emitted=1)
    stats.middle = middle
    metrics = Metrics()
    metrics.record(stats, latency_s=0.1, first_token_s=0.01, cancelled=False)
    metrics.record(GenerationStats(new_tokens=3), latency_s=0.1, first_token_s=0.01, cancelled=False)  # not a cascade
    text = metrics.render(waiting=0, running=0)
    for line in ("quasar_middle_verify_steps_total 2", "quasar_middle_proposed_tokens_total 6",
                 "quasar_middle_accepted_tokens_total 3", "quasar_middle_mean_accepted_tokens 2.5"):
        assert line in text.splitlines()
