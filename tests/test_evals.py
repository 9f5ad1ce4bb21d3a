"""Eval scorers on known answers, the packaged loaders, and `quasar eval` end to end on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import needs_kernels
from helpers import default_source, run_cli

from quasar.cli import main
from quasar.decoding.engine import Engine
from quasar.tools.evals import data, gsm8k, humaneval, mmlu
from quasar.tools.evals.runner import EvalConfig, evaluate, get_task, markdown_table, paired_delta_interval, wilson
from quasar.tools.evals.task import TaskOptions

# ---- loaders -------------------------------------------------------------------------------------


def test_loaders_read_the_whole_packaged_sets():
    assert len(data.gsm8k()) == 1319
    assert len(data.humaneval()) == 164
    items = data.mmlu()
    assert len(items) == 14042  # 14044 rows in the file, minus its 2 stray header rows
    assert {i.answer for i in items} == set(data.LETTERS)
    assert len({i.topic for i in items}) == 57


def test_limit_spreads_items_over_the_set_the_same_way_every_time():
    first, again = data.mmlu(limit=57), data.mmlu(limit=57)
    assert [i.id for i in first] == [i.id for i in again]
    assert len({i.topic for i in first}) > 40  # not 57 questions of the first subject
    assert data.spread(list(range(10)), 3) == [0, 3, 6]
    assert data.spread(list(range(4)), 10) == [0, 1, 2, 3]


# ---- GSM8K ---------------------------------------------------------------------------------------


def test_gsm8k_reference_and_answer_extraction():
    assert data.gsm8k()[0].answer == "18"
    assert data.gsm8k_reference("so 1,234 in all.\n#### 1,234") == "1234"
    assert gsm8k.extract_answer("She makes 9 * 2 = $18.\n#### 18") == "18"
    assert gsm8k.extract_answer("#### 7 is a guess.\nFinal: #### $1,250.00") == "1250"
    assert gsm8k.extract_answer("So the answer is 42. Bonus: 7 apples") == "42"
    assert gsm8k.extract_answer("the result is \\boxed{-3.5}") == "-3.5"
    assert gsm8k.extract_answer("3 + 4 = 7, then 7 * 2 = 14.") == "14"  # fallback: the last number
    assert gsm8k.extract_answer("I do not know.") is None


def test_gsm8k_scores_a_correct_and_a_wrong_answer():
    item = data.gsm8k()[0]
    right = "Janet sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 = 18 dollars.\n#### 18"
    wrong = "She sells 16 - 3 = 13 eggs for 13 * 2 = 26 dollars.\n#### 26"
    assert gsm8k.is_correct(right, item.answer)
    assert not gsm8k.is_correct(wrong, item.answer)
    assert not gsm8k.is_correct("no number here", item.answer)


# ---- HumanEval -----------------------------------------------------------------------------------

HAS_CLOSE = """    for i, a in enumerate(numbers):
        for j, b in enumerate(numbers):
            if i != j and abs(a - b) < threshold:
                return True
    return False
"""


def test_humaneval_harness_passes_a_right_body_and_fails_a_wrong_one():
    problem = data.humaneval()[0]
    assert problem.entry_point == "has_close_elements"
    assert humaneval.execute(problem, HAS_CLOSE) == (True, "passed")
    passed, verdict = humaneval.execute(problem, "    return False\n")
    assert not passed and verdict.startswith("failed")


def test_humaneval_harness_times_out_endless_code():
    passed, verdict = humaneval.execute(data.humaneval()[0], "    while True:\n        pass\n", timeout_s=1.0)
    assert not passed and verdict == "timed out"


def test_humaneval_truncates_at_the_next_top_level_statement():
    text = HAS_CLOSE + "\n\ndef helper():\n    pass\n"
    assert humaneval.truncate(text) == HAS_CLOSE + "\n"
    assert humaneval.truncate("    return 1\n```\nThis code ...") == "    return 1"
    assert humaneval.truncate("```\n\nThe function above ...") == ""  # the model closed the block at once
    assert humaneval.truncate("    return 1") == "    return 1"


# ---- MMLU ----------------------------------------------------------------------------------------


def test_mmlu_chooses_the_letter_with_the_highest_logit():
    letter_ids = {"A": (1, 5), "B": (2,), "C": (3, 7), "D": (4,)}
    logits = torch.zeros(10)  # [V]
    logits[7] = 3.0  # C's second spelling wins
    logits[2] = 2.5
    logits[9] = 10.0  # not a letter: ignored
    assert mmlu.choose(logits, letter_ids) == "C"
    logits[5] = 4.0
    assert mmlu.choose(logits, letter_ids) == "A"


def test_mmlu_letter_tokens_spell_their_letters(tiny_model):
    ids = mmlu.letter_token_ids(tiny_model.tokenizer)
    assert set(ids) == set(data.LETTERS)
    for letter, tokens in ids.items():
        assert tokens and all(tiny_model.tokenizer.decode([t]).strip() == letter for t in tokens)
    assert len({t for tokens in ids.values() for t in tokens}) == sum(len(t) for t in ids.values())


@needs_kernels
@pytest.mark.parametrize("verifier", ["bf16", "w8a8"])
def test_mmlu_prompts_that_share_a_start_reuse_its_cache_with_the_same_logits(verifier, monkeypatch):
    """Consecutive MMLU prompts run only what follows their common prefix (a subject's items, the template);
    each item's logits equal a fresh prefill's bitwise, including a prompt that repeats the previous one and
    one that outgrows the cache."""
    from quasar.model.kv_cache import StreamCache
    from quasar.verifiers.registry import load_verifier

    engine = Engine(load_verifier(default_source(), verifier))
    task = mmlu.MMLU()
    assert task.stream(engine) is not None and task.stream(engine) is task.stream(engine)  # quasar's kernels
    stream = StreamCache(engine.target.model, initial_len=64)  # small: the long prompt below outgrows it
    everything = data.mmlu()
    subject = [item for item in everything if item.topic == everything[0].topic][:3]
    items = [*subject, subject[-1], *data.mmlu(3)]
    ran: list[int] = []
    real_prefill = mmlu.prefill
    monkeypatch.setattr(mmlu, "prefill", lambda model, cache, ids: ran.append(len(ids)) or real_prefill(model, cache, ids))
    shared = []
    for item in items:
        ids = mmlu.encode(engine, item)
        fits = stream.cache is not None and stream.cache.max_len > len(ids)  # else a bigger cache, empty
        common = next((j for j, (a, b) in enumerate(zip(stream.cached, ids)) if a != b), min(len(ids), len(stream.cached)))
        shared.append(common if fits else 0)
        reused = mmlu.answer_logits(engine, ids, stream)
        assert ran[-1] == len(ids) - min(shared[-1], len(ids) - 1)  # only the rows after the common prefix ran
        assert torch.equal(reused, mmlu.answer_logits(engine, ids))
        assert stream.cached == ids and stream.cache.length == len(ids)
    assert shared[0] == 0 and shared[3] == len(mmlu.encode(engine, items[3]))  # a repeat: all shared
    assert min(shared[1:3]) > max(shared[5:]) > 10  # the subject's sentence too, within a subject
    assert task.score(engine, items[0], TaskOptions()).prediction in data.LETTERS


@pytest.mark.slow
def test_mmlu_default_model_answers_an_easy_question(default_model):
    item = data.MMLUItem("easy", "geography", "What is the capital of France?", ("Berlin", "Paris", "Rome", "Madrid"), "B")
    result = mmlu.MMLU().score(Engine(default_model), item, TaskOptions())
    assert result.prediction == "B" and result.correct


# ---- runner and command --------------------------------------------------------------------------


def test_evaluate_puts_verifiers_side_by_side(tiny_model_dir):
    config = EvalConfig(
        model=tiny_model_dir, verifiers=("fp32", "bf16"), tasks=("gsm8k", "mmlu", "humaneval"), limit=2,
        options=TaskOptions(max_new_tokens=4, timeout_s=5.0),
    )
    finished: list[int] = []
    report = evaluate(config, on_score=lambda partial: finished.append(len(partial.rows())))
    assert finished == [1, 2, 3, 4, 5, 6]  # each (verifier, task) is reported as soon as it is done
    rows = report.rows()
    assert [(r["task"], r["verifier"]) for r in rows] == [
        (t, v) for t in ("gsm8k", "mmlu", "humaneval") for v in ("fp32", "bf16")
    ]
    for row in rows:
        assert row["n"] == 2
        base = next(r for r in rows if r["task"] == row["task"] and r["verifier"] == "fp32")
        assert row["delta_pp"] == pytest.approx(row["accuracy_pct"] - base["accuracy_pct"])
        assert 0 <= row["agreement_pct"] <= 100
    assert all(r["delta_pp"] == 0 and r["agreement_pct"] == 100 for r in rows if r["verifier"] == "fp32")
    out = json.loads(json.dumps(report.to_dict()))
    assert len(out["items"]["bf16/mmlu"]) == 2 and out["items"]["bf16/mmlu"][0]["prediction"] in data.LETTERS
    assert "| mmlu | bf16 | 2 |" in markdown_table(report)
    for row in rows:  # what computed each row is in the report and the table
        assert row["path"] == "torch" or row["path"].startswith("kernels:")
    assert markdown_table(report).splitlines()[-1].endswith(f"| {rows[-1]['path']} |")
    for row in rows:  # every verifier scored the same items: a paired interval around each delta
        low, high = row["delta_ci95_pp"]
        assert low <= row["delta_pp"] <= high


@pytest.mark.parametrize("model, verifier", [("tiny", "fp32"), ("default", "w8a8")])
def test_batched_speculative_decoding_gives_each_item_its_plain_answer(model, verifier, tiny_model_dir):
    """Generative tasks decode several items at once with n-gram drafts; every answer is the one plain
    decoding gives the item alone (on real weights too), in item order, and the run says how it ran."""
    config = EvalConfig(model=tiny_model_dir if model == "tiny" else model, verifiers=(verifier,),
                        tasks=("gsm8k", "humaneval"), limit=5, options=TaskOptions(max_new_tokens=24, timeout_s=5.0))
    plain = evaluate(config, batch=1, drafter="none").to_dict()
    batched = evaluate(config, batch=3, drafter="ngram").to_dict()
    assert batched["run"] == {"batch": 3, "drafter": "ngram"} and plain["run"] == {"batch": 1, "drafter": "none"}
    for key, items in plain["items"].items():
        assert [r["id"] for r in items] == [item.id for item in get_task(key.split("/")[1]).load(5)]
        assert batched["items"][key] == items


def test_generated_answers_come_in_item_order_and_stopping_frees_the_caches(tiny_model):
    """Items that finish out of order still come in order, each with its plain decoding's answer; a prompt too
    long for the context window is scored wrong in its place; stopping early cancels the items in flight and
    gives the engine's cache pool back as it was."""
    from types import SimpleNamespace

    from quasar.tools.evals.runner import TOO_LONG, generated
    from quasar.tools.evals.task import ItemResult
    from quasar.decoding.sampling import SamplingParams

    class Echo:  # a generative task whose items say their prompt and token budget
        name = "echo"

        def ask(self, engine, item, options):
            return item.ids, SamplingParams(max_new_tokens=item.budget)

        def judge(self, item, completion, options):
            return ItemResult(item.id, True, completion)

    engine = Engine(tiny_model, max_context=48)
    budgets = [12, 2, 3, 1, 6, 2]  # the first runs longest: the others finish before it
    items = [SimpleNamespace(id=f"i{n}", ids=[10 + n, 20 + n, 30 + n], budget=b) for n, b in enumerate(budgets)]
    items.insert(3, SimpleNamespace(id="long", ids=[7] * 60, budget=4))
    spare = engine.caches.spare
    results = list(generated(Echo(), engine, items, TaskOptions(), batch=3))
    assert [r.id for r in results] == [item.id for item in items]
    assert results[3].output == TOO_LONG and not results[3].correct
    for item, result in zip(items, results):
        if item.id != "long":
            assert result.prediction == engine.generate(item.ids, SamplingParams(max_new_tokens=item.budget)).text
    stopped = generated(Echo(), engine, items, TaskOptions(), batch=3)
    next(stopped)
    stopped.close()
    assert engine.caches.taken == 0 and engine.caches.spare == spare and len(engine.caches.free) <= spare


def test_wilson_interval():
    assert wilson(0, 0) == (0.0, 100.0)
    low, high = wilson(50, 100)
    assert low == pytest.approx(40.38, abs=0.01) and high == pytest.approx(59.62, abs=0.01)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 100.0


def test_paired_delta_interval():
    same = [True, False] * 50
    assert paired_delta_interval(same, same) == (0.0, 0.0)  # the same answers: no difference at all
    better = [a or i % 10 == 1 for i, a in enumerate(same)]  # 10 of 100 items fixed, none broken
    low, high = paired_delta_interval(same, better)
    assert 3.0 <= low < 10.0 < high <= 18.0  # about 10 +- 1.96 * 3
    mirrored = paired_delta_interval(better, same)
    assert mirrored[0] == pytest.approx(-high, abs=1.5) and mirrored[1] == pytest.approx(-low, abs=1.5)
    assert paired_delta_interval(same, better) == (low, high)  # deterministic
    with pytest.raises(ValueError):
        paired_delta_interval(same, same[:-1])


def test_a_killed_run_goes_on_where_it_stopped(tiny_model_dir, tmp_path, monkeypatch):
    """A report saved midway (every item here) is resumed: its items are kept, the rest scored, and the result
    equals an uninterrupted run's; a verifier whose tasks are all done is not even loaded."""
    from quasar.tools.evals import runner

    config = EvalConfig(model=tiny_model_dir, verifiers=("fp32", "bf16"), tasks=("mmlu", "gsm8k"), limit=3,
                        options=TaskOptions(max_new_tokens=4))
    whole = evaluate(config).to_dict()
    monkeypatch.setattr(runner, "CHECKPOINT_S", 0.0)
    saved: list[dict] = []

    def stop_after_four(partial):
        saved.append(json.loads(json.dumps(partial.to_dict())))
        if sum(len(v) for v in saved[-1]["items"].values()) == 4:
            raise KeyboardInterrupt  # killed during fp32's gsm8k

    with pytest.raises(KeyboardInterrupt):
        evaluate(config, on_progress=stop_after_four)
    loaded: list[str] = []
    from quasar import builder

    real_load = builder.load_verifier
    monkeypatch.setattr(builder, "load_verifier", lambda *a, **k: loaded.append(str(a[1])) or real_load(*a, **k))
    resumed = evaluate(config, resume=saved[-1]).to_dict()
    for key in whole["items"]:
        assert [r["prediction"] for r in resumed["items"][key]] == [r["prediction"] for r in whole["items"][key]]
    assert loaded == ["fp32", "bf16"]
    loaded.clear()
    again = evaluate(config, resume=resumed)
    assert loaded == [] and again.rows()[0]["n"] == 3  # all done: nothing loaded
    other = EvalConfig(model=tiny_model_dir, verifiers=("fp32", "bf16"), tasks=("mmlu", "gsm8k"), limit=2)
    with pytest.raises(ValueError, match="other settings.*limit"):
        evaluate(other, resume=resumed)


def test_a_row_resumed_on_other_kernel_paths_says_so(tiny_model_dir, caplog):
    """bf16 sums on AMX tiles are other floats than on the other paths: a row continued on a machine whose paths
    differ from those that scored its first items names both (and the run warns); a finished row keeps its own."""
    config = EvalConfig(model=tiny_model_dir, verifiers=("fp32", "bf16"), tasks=("mmlu",), limit=2)
    saved = json.loads(json.dumps(evaluate(config).to_dict()))
    here = saved["rows"][1]["path"]
    del saved["items"]["bf16/mmlu"][1:]
    for row in saved["rows"]:
        row["path"] = "kernels:elsewhere"
    report = evaluate(config, resume=saved)
    assert [r["path"] for r in report.rows()] == ["kernels:elsewhere", f"kernels:elsewhere, then {here}"]
    assert f"bf16/mmlu: its first 1 items ran on kernels:elsewhere, the rest run on {here} here" in caplog.text
    again = json.loads(json.dumps(report.to_dict()))  # continued once more on the same paths: nothing to add
    del again["items"]["bf16/mmlu"][1:]
    assert evaluate(config, resume=again).rows()[1]["path"] == f"kernels:elsewhere, then {here}"
    for row in again["rows"]:  # a report from before paths were saved
        del row["path"]
    assert [r["path"] for r in evaluate(config, resume=again).rows()] == ["", f"not recorded, then {here}"]


def test_a_resumed_run_may_add_verifiers_but_not_leave_one_out(tiny_model_dir, monkeypatch):
    """A verifier added to a finished report is the only one scored (the saved items kept as they are);
    leaving a saved verifier out is refused, since its items would be dropped from the report."""
    from quasar.tools.evals import runner

    first = EvalConfig(model=tiny_model_dir, verifiers=("fp32",), tasks=("mmlu",), limit=2)
    saved = json.loads(json.dumps(evaluate(first).to_dict()))
    loaded: list[str] = []
    from quasar import builder

    real_load = builder.load_verifier
    monkeypatch.setattr(builder, "load_verifier", lambda *a, **k: loaded.append(str(a[1])) or real_load(*a, **k))
    grown = EvalConfig(model=tiny_model_dir, verifiers=("fp32", "bf16"), tasks=("mmlu",), limit=2)
    report = evaluate(grown, resume=saved).to_dict()
    assert loaded == ["bf16"]
    assert report["items"]["fp32/mmlu"] == saved["items"]["fp32/mmlu"] and len(report["items"]["bf16/mmlu"]) == 2
    assert [row["verifier"] for row in report["rows"]] == ["fp32", "bf16"]
    fewer = EvalConfig(model=tiny_model_dir, verifiers=("bf16",), tasks=("mmlu",), limit=2)
    with pytest.raises(ValueError, match="other settings \\(verifiers\\).*not left out"):
        evaluate(fewer, resume=report)


def test_a_resumed_run_saves_every_saved_item_before_it_scores_anything(tiny_model_dir):
    """A resumed run that scores a new verifier first and is stopped there must not drop the items a later
    verifier had already scored from what it saves (a run with another order once lost them)."""
    first = EvalConfig(model=tiny_model_dir, verifiers=("fp32", "bf16"), tasks=("mmlu",), limit=2)
    saved = json.loads(json.dumps(evaluate(first).to_dict()))
    del saved["items"]["bf16/mmlu"][1:]  # bf16 stopped after one item
    saves: list[dict] = []
    grown = EvalConfig(model=tiny_model_dir, verifiers=("w8a16", "fp32", "bf16"), tasks=("mmlu",), limit=2)

    def stop_after_the_first_save(report) -> None:
        saves.append(report.to_dict())
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        evaluate(grown, on_score=stop_after_the_first_save, resume=saved)
    assert saves[0]["items"]["bf16/mmlu"] == saved["items"]["bf16/mmlu"]
    assert saves[0]["items"]["fp32/mmlu"] == saved["items"]["fp32/mmlu"] and len(saves[0]["items"]["w8a16/mmlu"]) == 2


def test_eval_command_resumes_from_its_out_file(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    args = ["eval", "--model", str(tiny_model_dir), "--tasks", "mmlu", "--limit", "2", "--json", "--out", str(out)]
    assert main(args) == 0
    first = json.loads(out.read_text())
    assert main([*args, "--resume"]) == 0  # everything was done: the same report
    assert json.loads(out.read_text())["items"] == first["items"]
    capsys.readouterr()
    assert main([*args, "--resume", "--overwrite"]) == 1
    assert "--resume" in capsys.readouterr().err


def test_eval_config_rejects_repeated_verifiers_and_bad_limits():
    with pytest.raises(ValueError, match="twice"):
        EvalConfig(verifiers=("fp32", "fp32"))
    with pytest.raises(ValueError, match="limit"):
        EvalConfig(limit=0)


def test_eval_command_prints_json(tiny_model_dir, tmp_path):
    out = tmp_path / "report.json"
    result = run_cli("eval", "--model", str(tiny_model_dir), "--tasks", "mmlu", "--limit", "3", "--json", "--out", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["rows"][0]["task"] == "mmlu" and summary["rows"][0]["n"] == 3
    assert len(json.loads(out.read_text())["items"]["fp32/mmlu"]) == 3


@pytest.mark.parametrize("args, message", [
    (("--verifier", "fp32,w9a9"), "unknown verifier"), (("--tasks", "mmlu,trivia"), "unknown eval task"),
    (("--drafter", "telepathy"), "unknown drafter"),
])
def test_eval_command_refuses_unknown_names_before_loading(args, message, capsys):
    assert main(["eval", "--model", "/nonexistent/model", "--limit", "1", *args]) == 1
    err = capsys.readouterr().err
    assert message in err and "does not exist" not in err


def test_an_existing_report_is_refused_without_overwrite(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    out.write_text('{"earlier": "run"}')
    args = ["eval", "--model", str(tiny_model_dir), "--tasks", "mmlu", "--limit", "1", "--json", "--out", str(out)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "--overwrite" in err and err.count("\n") == 1
    assert out.read_text() == '{"earlier": "run"}'
    assert main([*args, "--overwrite"]) == 0
    assert len(json.loads(out.read_text())["items"]["fp32/mmlu"]) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left


SAVE_UNDER_A_SIZE_LIMIT = """
import resource, signal, sys
from quasar.commands.eval import save
from quasar.tools.evals.runner import EvalConfig, EvalReport, TaskScore
from quasar.tools.evals.task import ItemResult

report = EvalReport(EvalConfig(tasks=("mmlu",)))
items = [ItemResult(f"mmlu/{i}", True, "A", "x" * 100) for i in range(1000)]  # about 150 kB of JSON
report.scores[("fp32", "mmlu")] = TaskScore("mmlu", "fp32", items, 1.0)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    save(report, __import__("pathlib").Path(sys.argv[1]))
except OSError as e:
    print("failed:", e.strerror)
"""


def test_a_report_write_that_stops_midway_keeps_the_previous_report(tmp_path):
    """A save cut off midway (here by the file-size limit, as a full disk would) leaves the last complete report."""
    out = tmp_path / "report.json"
    out.write_text('{"previous": "complete"}')
    proc = subprocess.run([sys.executable, "-c", SAVE_UNDER_A_SIZE_LIMIT, str(out)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert "failed: File too large" in proc.stdout, proc.stderr
    assert json.loads(out.read_text()) == {"previous": "complete"}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
