"""Suite loaders on the packaged data files: counts, shapes, hash checks, and no calibration item."""

from __future__ import annotations

import collections

import pytest

from quasar.tools.bench import suites


def test_mtbench_has_80_questions_of_two_turns_in_8_categories():
    items = suites.mtbench_items()
    assert len(items) == 80
    assert all(len(item.turns) == 2 for item in items)
    assert collections.Counter(item.category for item in items) == {c: 10 for c in suites.MTBENCH_CATEGORIES}


def test_humaneval_and_gsm8k_counts():
    humaneval, gsm8k = suites.humaneval_items(), suites.gsm8k_items()
    assert len(humaneval) == 164 and humaneval[0].question_id == "HumanEval/0"
    assert "def has_close_elements" in humaneval[0].turns[0]
    assert len(gsm8k) == 1319 and "Janet" in gsm8k[0].turns[0]


def test_long_context_items_carry_a_long_passage():
    items = suites.long_context_items()
    assert len(items) >= 60 and len({i.question_id for i in items}) == len(items)
    assert all(len(i.turns[0]) > suites.PASSAGE_CHARS // 2 for i in items)
    first_tasks = {i.turns[0].split("\n")[0] for i in items[:3]}
    assert len(first_tasks) == 3  # any prefix mixes the tasks


def test_suite_sizes():
    quick = suites.load_suite("quick")
    assert collections.Counter(i.category for i in quick) == {c: 1 for c in suites.CATEGORIES}
    spec = collections.Counter(i.category for i in suites.load_suite("spec"))
    assert spec["gsm8k"] == 80 and spec["humaneval"] == 80 and spec["writing"] == 10
    assert len(suites.load_suite("quick", per_category=1, categories=("gsm8k", "coding"))) == 2
    with pytest.raises(ValueError, match="unknown categories"):
        suites.load_suite("quick", categories=("poetry",))


def calibration_texts() -> list[str]:
    from quasar.quant.calibration import CalibrationSpec
    from quasar.quant.calibration import calibration_texts as quant_texts

    return quant_texts(CalibrationSpec())


def test_no_calibration_item_is_in_any_suite():
    texts = calibration_texts()
    assert len(texts) == 200
    prompts = "\n".join(turn for item in suites.all_items() for turn in item.turns)
    leaked = [t for t in texts if t[:60].strip() in prompts]
    assert leaked == []
