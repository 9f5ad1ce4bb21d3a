"""Bench metrics on hand-made records: speedup, mean accepted tokens, acceptance rate, divergence detection."""

from __future__ import annotations

import pytest

from quasar.tools.bench.metrics import (
    acceptance_rate,
    divergences,
    first_difference,
    mean_accepted_tokens,
    prompt_share,
    reference_method,
    speedup,
    summarize,
)


def record(method, qid, tokens, seconds, accept_lengths=(), token_ids=None, category="math", temperature=0.0,
           proposed=0, accepted=0):
    turns = token_ids if token_ids is not None else [list(range(tokens))]
    return {
        "question_id": qid, "category": category, "model_id": method, "temperature": temperature,
        "choices": [{"turns": ["x"], "new_tokens": [tokens], "wall_time": [seconds],
                     "decoding_steps": [len(accept_lengths)], "accept_lengths": list(accept_lengths),
                     "token_ids": turns, "stats": [{"proposed_tokens": proposed, "accepted_tokens": accepted}]}],
    }


def test_speedup_is_total_tokens_over_total_time_on_shared_questions():
    base = [record("ar:bf16", "q1", 100, 10.0), record("ar:bf16", "q2", 100, 10.0), record("ar:bf16", "q3", 50, 1.0)]
    fast = [record("ngram+bf16", "q1", 100, 5.0), record("ngram+bf16", "q2", 100, 3.0)]
    # q3 is not shared: baseline 200 tok / 20 s = 10 tok/s; method 200 tok / 8 s = 25 tok/s
    assert speedup(fast, base) == pytest.approx(2.5)
    assert speedup(base, base) == pytest.approx(1.0)
    assert speedup(fast, []) is None


def test_prompt_share_is_prompt_seconds_over_wall_seconds_where_every_turn_reports_them():
    def timed(qid, walls, prefills):
        r = record("ar:w4a8", qid, 10, 1.0)
        r["choices"][0]["wall_time"] = list(walls)
        r["choices"][0]["stats"] = [{"prefill_s": p, "decode_s": w - p} for w, p in zip(walls, prefills)]
        return r

    assert prompt_share([timed("q1", [4.0, 2.0], [1.0, 0.5]), timed("q2", [2.0], [1.5])]) == pytest.approx(3.0 / 8.0)
    assert prompt_share([timed("q1", [4.0], [1.0]), record("llamacpp:ar:file", "q2", 10, 1.0)]) is None  # no prefill_s
    missing_turn = timed("q1", [4.0, 2.0], [1.0, 0.5])
    missing_turn["choices"][0]["stats"].pop()
    assert prompt_share([missing_turn]) is None
    assert prompt_share([]) is None
    assert summarize([timed("q1", [4.0], [1.0])])[0]["prompt_share"] == pytest.approx(0.25)


def test_mean_accepted_tokens_and_acceptance_rate():
    rs = [record("ngram+bf16", "q1", 7, 1.0, accept_lengths=[3, 1, 2], proposed=10, accepted=4),
          record("ngram+bf16", "q2", 3, 1.0, accept_lengths=[2, 1], proposed=5, accepted=1)]
    assert mean_accepted_tokens(rs) == pytest.approx(9 / 5)
    assert acceptance_rate(rs) == pytest.approx(5 / 15)
    assert mean_accepted_tokens([record("hf:ar", "q1", 5, 1.0)]) is None  # no steps reported
    assert acceptance_rate([record("ar:bf16", "q1", 5, 1.0, accept_lengths=[1] * 5)]) is None


def test_summarize_rows_per_category_and_overall_with_both_baselines():
    rs = [
        record("ar:bf16", "q1", 100, 10.0, category="math"), record("ar:bf16", "q2", 100, 20.0, category="coding"),
        record("ngram+bf16", "q1", 100, 5.0, category="math"), record("ngram+bf16", "q2", 100, 10.0, category="coding"),
        record("ngram+w8a8", "q1", 100, 4.0, category="math"), record("ngram+w8a8", "q2", 100, 5.0, category="coding"),
    ]
    rows = {(r["method"], r["category"]): r for r in summarize(rs)}
    assert [r["category"] for r in summarize(rs)][-1] == "all"
    assert rows[("ngram+bf16", "math")]["speedup_vs_ar:bf16"] == pytest.approx(2.0)
    assert rows[("ngram+w8a8", "coding")]["speedup_vs_ngram+bf16"] == pytest.approx(2.0)
    # overall: 200 tokens in 9 s vs 200 tokens in 15 s
    assert rows[("ngram+w8a8", "all")]["speedup_vs_ngram+bf16"] == pytest.approx(15 / 9)
    assert rows[("ngram+w8a8", "all")]["prompts"] == 2
    assert rows[("ar:bf16", "all")]["tokens_per_s"] == pytest.approx(200 / 30)


def test_reference_method_names():
    assert reference_method("ngram+w8a8") == "ar:w8a8"
    assert reference_method("model:/a/b.gguf+bf16") == "ar:bf16"
    assert reference_method("hf:pld") == "hf:ar"
    assert reference_method("llamacpp:pld:f16") == "llamacpp:ar:f16"
    assert reference_method("ar:bf16") is None and reference_method("hf:ar") is None


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_divergence_detection_flags_greedy_and_matched_sampled_mismatches():
    same = [[5, 6, 7], [8, 9]]
    rs = [
        record("ar:w8a8", "q1", 5, 1.0, token_ids=same),
        record("ngram+w8a8", "q1", 5, 1.0, token_ids=same),
        record("ar:w8a8", "q2", 5, 1.0, token_ids=[[1, 2, 3], [4, 5]]),
        record("ngram+w8a8", "q2", 5, 1.0, token_ids=[[1, 2, 3], [4, 6]]),  # second turn differs at token 1
        record("ar:w8a8", "q3", 3, 1.0, token_ids=[[1, 2, 3]], temperature=1.0),
        record("ngram+w8a8", "q3", 3, 1.0, token_ids=[[1, 9, 9]], temperature=1.0),  # matched: compared sampled too
        record("layerskip:4+w8a8", "q3", 3, 1.0, token_ids=[[9, 9, 9]], temperature=1.0),  # sampled drafts: not
        record("ngram+bf16", "q1", 5, 1.0, token_ids=[[0]]),  # no ar:bf16 reference in the run
    ]
    found = divergences(rs)
    assert found == [{"method": "ngram+w8a8", "reference": "ar:w8a8", "question_id": "q2", "turn": 1,
                      "position": 1, "category": "math"},
                     {"method": "ngram+w8a8", "reference": "ar:w8a8", "question_id": "q3", "turn": 0,
                      "position": 1, "category": "math"}]
