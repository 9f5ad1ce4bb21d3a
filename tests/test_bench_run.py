"""The bench end to end on tiny models: the CLI smoke run, the runner's interleaving, Ctrl-C, divergence
checks against real decoders, the memory-wall probe and the peers' step accounting."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from quasar.tools.bench import bandwidth
from quasar.tools.bench.base import MethodOptions, Pool
from quasar.tools.bench.methods import EngineMethod, build_method
from quasar.tools.bench.metrics import divergences
from quasar.tools.bench.peers import step_lengths
from quasar.tools.bench.runner import RunConfig, run
from quasar.tools.bench.suites import BenchItem
from quasar.cli import main
from quasar.decoding.engine import Engine
from quasar.decoding.outputs import RequestOutput
from quasar.decoding.stats import GenerationStats

PLOTS = ("accept_lengths.png", "speedup_by_category.png", "speedup_vs_temperature.png", "verify_forward.png")


def test_quick_bench_cli_on_a_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "quasar", "bench", "--suite", "quick", "--model", str(tiny_model_dir),
           "--methods", "ar:fp32,ar:bf16,llamacpp:ar", "--limit", "1", "--categories", "writing,long-context",
           "--max-new-tokens", "4", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "quasar bench, temperature 0" in proc.stdout and "ar:fp32" in proc.stdout
    assert "skipping llamacpp:ar" in proc.stderr  # not installed, or (installed) the tiny model is no GGUF
    if importlib.util.find_spec("llama_cpp") is None:
        assert "pip install llama-cpp-python" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    overall = {r["method"]: r for r in summary["rows"] if r["category"] == "all"}
    assert set(overall) == {"ar:fp32", "ar:bf16"}
    assert overall["ar:bf16"]["speedup_vs_ar:bf16"] == pytest.approx(1.0)
    assert overall["ar:fp32"]["mean_accepted_tokens"] == pytest.approx(1.0)
    assert summary["skipped"] == ["long-0-0-0"]  # its passage does not fit the tiny model's 512-token window
    assert summary["memory_wall"]["bandwidth_bytes_per_s"] > 0
    assert set(summary["memory_wall"]["curves"]) == {"fp32", "bf16"}
    records = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(records) == 2  # 1 question x 2 methods
    writing = next(r for r in records if r["category"] == "writing")
    assert len(writing["choices"][0]["turns"]) == 2 and writing["choices"][0]["new_tokens"] == [4, 4]
    for key in ("question_id", "category", "model_id", "choices"):
        assert key in writing
    for key in ("new_tokens", "wall_time", "decoding_steps", "accept_lengths", "token_ids", "stats"):
        assert key in writing["choices"][0]
    machine = summary["machine"]  # every figure beside the paths that ran it
    assert f"int8 {machine['int8_path']}" in proc.stdout and f"float {machine['float_path']}" in proc.stdout
    path = overall["ar:bf16"]["path"]
    assert path == "torch" or path.startswith("kernels:")
    assert f"| all | ar:bf16 | {path} |" in (out / "summary.md").read_text()
    assert f"machine: {summary['config']['machine']}" in (out / "summary.md").read_text()
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_earlier_run_is_refused_without_overwrite(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    out.mkdir()
    earlier = '{"question_id": "from an earlier run"}\n'
    (out / "answers.jsonl").write_text(earlier)
    args = ["bench", "--model", str(tiny_model_dir), "--methods", "ar:fp32", "--limit", "1", "--categories", "math",
            "--max-new-tokens", "2", "--no-memory-wall", "--no-plots", "--out", str(out)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "--overwrite" in err and err.count("\n") == 1
    assert [p.name for p in out.iterdir()] == ["answers.jsonl"] and (out / "answers.jsonl").read_text() == earlier
    assert main([*args, "--overwrite"]) == 0
    records = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert [(r["question_id"], r["model_id"]) for r in records] == [("mt-111", "ar:fp32")]
    assert json.loads((out / "summary.json").read_text())["config"]["prompts"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["bench"]  # no temporary sibling left behind


def test_overwrite_replaces_only_a_bench_output(tiny_model_dir, tmp_path, capsys):
    """--overwrite replaces the whole directory, so one holding files bench did not write is refused."""
    (tmp_path / "notes.txt").write_text("mine")
    args = ["bench", "--model", str(tiny_model_dir), "--methods", "ar:fp32", "--out", str(tmp_path), "--overwrite"]
    assert main(args) == 1
    assert "notes.txt" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


class ScriptedMethod:
    """A fake method: emits fixed tokens; raises KeyboardInterrupt on the question named `stop_at`."""

    def __init__(self, name: str, tokens: list[int], stop_at: str | None = None) -> None:
        self.name, self.tokens, self.stop_at, self.calls = name, tokens, stop_at, []

    def generate(self, messages, params):
        self.calls.append(messages[0]["content"])
        if messages[0]["content"] == self.stop_at:
            raise KeyboardInterrupt
        stats = GenerationStats(new_tokens=len(self.tokens), decode_s=0.01)
        stats.record_step(0, 0, len(self.tokens))
        return RequestOutput(text="text", token_ids=list(self.tokens), stats=stats)


ITEMS = [BenchItem(f"q{i}", "math", (f"question {i}",)) for i in range(3)]


def test_runner_interleaves_methods_prompt_by_prompt(tmp_path):
    a, b = ScriptedMethod("ar:fp32", [1, 2]), ScriptedMethod("ngram+fp32", [1, 3])
    result = run([a, b], ITEMS, RunConfig(warmup_tokens=1), tmp_path / "answers.jsonl")
    assert a.calls[1:] == b.calls[1:] == [f"question {i}" for i in range(3)]  # after one warm-up each
    assert [r["model_id"] for r in result.records] == ["ar:fp32", "ngram+fp32"] * 3
    assert divergences(result.records)[0]["position"] == 1  # the runner's records feed the divergence check


class TimedMethod(ScriptedMethod):
    """A fake method whose answers take the given wall times, one call after another (after its warm-up)."""

    def __init__(self, name: str, times: list[float]) -> None:
        super().__init__(name, [1, 2])
        self.times = [0.0, *times]
        self.forgotten = 0

    def forget(self):
        self.forgotten += 1

    def generate(self, messages, params):
        out = super().generate(messages, params)
        out.stats.decode_s = self.times[len(self.calls) - 1]
        return out


def test_repeats_keep_each_methods_answer_of_median_time(tmp_path):
    items = ITEMS[:2]
    a, b = TimedMethod("ar:x", [3.0, 1.0, 2.0, 5.0, 6.0, 4.0]), TimedMethod("ngram+x", [1.0, 1.0, 9.0, 2.0, 2.0, 2.0])
    result = run([a, b], items, RunConfig(warmup_tokens=1, repeat=3), tmp_path / "answers.jsonl")
    assert a.calls[1:] == b.calls[1:] == ["question 0"] * 3 + ["question 1"] * 3  # interleaved, prompt by prompt
    kept = {(r["model_id"], r["question_id"]): r for r in result.records}
    assert len(result.records) == 4
    assert {key: sum(r["choices"][0]["wall_time"]) for key, r in kept.items()} == pytest.approx(
        {("ar:x", "q0"): 2.0, ("ar:x", "q1"): 5.0, ("ngram+x", "q0"): 1.0, ("ngram+x", "q1"): 2.0})
    assert kept[("ar:x", "q0")]["wall_times"] == pytest.approx([3.0, 1.0, 2.0])
    assert a.forgotten == b.forgotten == 6  # every round starts from no kept cache
    written = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [(r["model_id"], r["question_id"]) for r in written] == [("ar:x", "q0"), ("ngram+x", "q0"),
                                                                    ("ar:x", "q1"), ("ngram+x", "q1")]


def test_repeats_stop_when_every_method_failed(tmp_path):
    class Broken(TimedMethod):
        def generate(self, messages, params):
            if messages[0]["content"] != "Write one sentence about the sea.":
                raise RuntimeError("no")
            return super().generate(messages, params)

    result = run([Broken("ar:x", [1.0] * 6)], ITEMS[:2], RunConfig(warmup_tokens=1, repeat=3), tmp_path / "a.jsonl")
    assert result.records == [] and "ar:x" in result.failed


def test_ctrl_c_keeps_finished_prompts(tmp_path, caplog):
    answers = tmp_path / "answers.jsonl"
    result = run([ScriptedMethod("ar:x", [1], stop_at="question 1")], ITEMS, RunConfig(), answers)
    assert result.interrupted and "keeping the 1 prompts that finished" in caplog.text
    assert [json.loads(line)["question_id"] for line in answers.read_text().splitlines()] == ["q0"]


def test_greedy_speculative_matches_plain_decoding_through_the_bench(tiny_model, tmp_path):
    from quasar.decoding.drafters import build_drafter
    from quasar.decoding.speculative import Speculative

    plain = EngineMethod("ar:fp32", Engine(tiny_model))
    spec = EngineMethod("ngram+fp32", Engine(tiny_model, decoder=Speculative(build_drafter("ngram", tiny_model), 5)))
    items = [BenchItem("r", "math", ("one two three one two three one two three",))]
    result = run([plain, spec], items, RunConfig(max_new_tokens=24), tmp_path / "answers.jsonl")
    assert len(result.records) == 2
    assert divergences(result.records) == []


def test_a_method_names_what_runs_it(tiny_model_dir):
    pool = Pool(MethodOptions(model=str(tiny_model_dir)))
    plain, cascade = build_method("ar:fp32", pool), build_method("ngram+fp32+bf16", pool)
    fp32, bf16 = pool.verifier("fp32").model.plan.paths, pool.verifier("bf16").model.plan.paths
    assert plain.path == fp32 and cascade.path == f"{fp32} > {bf16}"


def test_unknown_and_incomplete_methods_fail_clearly():
    pool = Pool(MethodOptions())
    with pytest.raises(ValueError, match="unknown method"):
        build_method("turbo", pool)
    with pytest.raises(ValueError, match="unknown method"):
        build_method("ar:", pool)
    with pytest.raises(ValueError, match="hf:ar or hf:pld"):
        build_method("hf:beam", pool)


def test_step_lengths_from_forward_starts():
    # prompt of 10; plain decoding of 4 tokens: prefill emits 1, then 3 one-token steps at 10, 11, 12
    assert step_lengths([(0, 10), (10, 1), (11, 1), (12, 1)], 10, 14) == [1, 1, 1]
    # prompt lookup: prefill scores 3 drafts too (emits 3), then a step at 12 that emits 4, then one at 16
    assert step_lengths([(0, 13), (12, 6), (16, 1)], 10, 18) == [3, 4, 1]


def test_memory_wall_measurements(tiny_model):
    model = tiny_model.model
    embedding = model.model.embed_tokens.weight
    expected = sum(p.numel() * 4 for p in model.parameters()) - embedding.numel() * 4
    expected += sum(b.numel() * b.element_size() for b in model.buffers())
    assert bandwidth.bytes_per_forward(model) == expected
    times = bandwidth.verify_forward_times(model, context=16, scored=(1, 4), repeats=2)
    assert set(times) == {1, 4} and all(t > 0 for t in times.values())
    assert bandwidth.read_bandwidth(8 << 20, repeats=2) > 1e6


def test_memory_wall_forwards_start_cold(tiny_model, monkeypatch):
    assert bandwidth.cache_sweep(1 << 20)() is None
    sweeps = []
    monkeypatch.setattr(bandwidth, "cache_sweep", lambda: lambda: sweeps.append(1))
    bandwidth.verify_forward_times(tiny_model.model, context=16, scored=(1, 4), repeats=2)
    assert len(sweeps) == 2 * 3  # before every forward, the warm-up ones too
    sweeps.clear()
    bandwidth.verify_forward_times(tiny_model.model, context=16, scored=(1, 4), repeats=2, cold=False)
    assert not sweeps


@pytest.mark.parametrize("mode", ["ar", "pld"])
def test_transformers_peer_counts_its_steps(tiny_model_dir, mode):
    from quasar.tools.bench.peers import HFMethod
    from quasar.decoding.sampling import SamplingParams

    method = HFMethod(f"hf:{mode}", tiny_model_dir, 10 if mode == "pld" else None)
    messages = [{"role": "user", "content": "one two three one two three one two three"}]
    greedy, sampled = SamplingParams(max_new_tokens=12, ignore_eos=True), SamplingParams(temperature=1.0, seed=1, max_new_tokens=12)
    for params in (greedy, sampled):
        out = method.generate(messages, params)
        n, lengths = len(out.token_ids), out.stats.accept_lengths
        assert (n == 12 if params.ignore_eos else 1 <= n <= 12) and out.stats.wall_s > 0
        assert sum(lengths) in (n - 1, n)  # every token but the prefill's comes from a counted step
        if mode == "ar":
            assert set(lengths) <= {1}


def test_quantized_checkpoint_serves_the_int8_verifiers_only(monkeypatch):
    from quasar import builder
    from quasar.model.source import ModelSource

    model = ModelSource("float-model", Path("float-model"), "hf", "llama", ("float",))
    ckpt = ModelSource("ckpt", Path("ckpt"), "quantized", "llama", ("w8a8",))
    calls = []
    monkeypatch.setattr(builder, "load_verifier", lambda source, spec: calls.append((source.name, str(spec))) or spec)
    pool = Pool(MethodOptions(model=model, quantized=ckpt))
    for name in ("bf16", "w8a8", "w8a16", "w8a8:0.5"):
        pool.verifier(name)
    assert calls == [("float-model", "bf16"), ("ckpt", "w8a8"), ("ckpt", "w8a16"), ("ckpt", "w8a8:0.5")]


def test_a_failing_method_is_reported_and_dropped_not_fatal(tmp_path):
    class Broken:
        name = "broken"

        def generate(self, messages, params):
            raise ValueError("peer bug")

    class Fine:
        name = "fine"

        def generate(self, messages, params):
            return RequestOutput(text="ok", token_ids=[1], stats=GenerationStats(new_tokens=1, decode_s=0.01))

    items = [BenchItem(f"q{i}", "writing", ("hi",)) for i in range(3)]
    result = run([Broken(), Fine()], items, RunConfig(max_new_tokens=4), tmp_path / "a.jsonl")
    assert [r["model_id"] for r in result.records] == ["fine"] * 3
    assert result.failed == {"broken": "warm-up: ValueError: peer bug"}
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 3


def test_a_method_failing_mid_run_keeps_its_finished_answers(tmp_path):
    class Flaky:
        name, calls = "flaky", 0

        def generate(self, messages, params):
            Flaky.calls += 1
            if Flaky.calls > 2:  # warm-up and q0 succeed, q1 fails
                raise RuntimeError("boom")
            return RequestOutput(text="ok", token_ids=[1], stats=GenerationStats(new_tokens=1, decode_s=0.01))

    items = [BenchItem(f"q{i}", "writing", ("hi",)) for i in range(3)]
    result = run([Flaky()], items, RunConfig(max_new_tokens=4), tmp_path / "a.jsonl")
    assert [r["question_id"] for r in result.records] == ["q0"]
    assert result.failed == {"flaky": "q1: RuntimeError: boom"}


def test_the_summary_shows_only_the_baselines_that_ran():
    from quasar.tools.bench.report import markdown

    row = {"category": "all", "method": "ngram+gguf", "path": "kernels:x", "prompts": 1, "new_tokens": 8,
           "tokens_per_s": 10.0, "mean_accepted_tokens": 2.0, "acceptance_rate": 0.5, "prompt_share": 0.1,
           "speedup_vs_ar:bf16": None, "speedup_vs_ngram+bf16": None, "speedup_vs_plain": 1.5, "temperature": 0.0}
    header = markdown([row], []).splitlines()[2]
    assert "x plain" in header and "x ar:bf16" not in header and "x ngram+bf16" not in header
    with_baseline = markdown([row | {"speedup_vs_ar:bf16": 2.0}], []).splitlines()[2]
    assert "x ar:bf16" in with_baseline and "x ngram+bf16" not in with_baseline
