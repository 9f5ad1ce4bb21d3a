"""The real `quasar` command in a subprocess: streaming, --json, stdin, and bad input without tracebacks."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from quasar.cli import main


def quasar(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "quasar", *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )


def assert_clean_error(result: subprocess.CompletedProcess, match: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert match in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_help_explains_every_subcommand():
    top = quasar("--help")
    assert top.returncode == 0 and "generate" in top.stdout
    sub = quasar("generate", "--help")
    assert sub.returncode == 0
    for flag in ("--model", "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--json", "--no-chat"):
        assert flag in sub.stdout


def test_generate_json_on_default_model(default_model):
    # "What is the capital of France?" alone opens on a near tie in the float model itself ("The" 0.152 vs
    # "L" 0.140, the start of "L'Étoile, ..."), which any int8 rounding may flip; this prompt does not.
    result = quasar("generate", "What is the capital of France? Answer with one word.", "--max-new-tokens", "12", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert "Paris" in out["text"]
    assert 0 < len(out["token_ids"]) <= 12
    for key in ("prompt_tokens", "new_tokens", "prefill_s", "decode_s", "tokens_per_s", "peak_rss_mb"):
        assert key in out["stats"]
    assert out["stats"]["new_tokens"] == len(out["token_ids"])


def test_generate_exact_gives_the_float_models_tokens(default_model):
    """--exact (the cascade w8a8+bf16) answers with --verifier bf16's greedy tokens and reports its middle level."""
    prompt = ["Write a haiku about the sea.", "--max-new-tokens", "24", "--json"]
    exact, float_ = quasar("generate", *prompt, "--exact"), quasar("generate", *prompt, "--verifier", "bf16")
    assert exact.returncode == 0 and float_.returncode == 0, exact.stderr + float_.stderr
    exact_out, float_out = json.loads(exact.stdout), json.loads(float_.stdout)
    assert exact_out["token_ids"] == float_out["token_ids"]
    assert exact_out["stats"]["middle"]["verify_steps"] > 0 and float_out["stats"]["middle"] is None


def test_streamed_text_equals_json_text_and_stdin_prompt(tiny_model_dir):
    args = ["--model", str(tiny_model_dir), "--max-new-tokens", "16", "--no-chat", "--ignore-eos"]
    streamed = quasar("generate", "-", *args, stdin="Once upon a time")
    as_json = quasar("generate", "Once upon a time", *args, "--json")
    assert streamed.returncode == 0 and as_json.returncode == 0, streamed.stderr + as_json.stderr
    out = json.loads(as_json.stdout)
    assert streamed.stdout == out["text"] + "\n"
    assert out["path"].startswith(("kernels:", "torch"))  # what computed it, as the bench and eval name it
    line = r"^16 tokens in [\d.]+ s, [\d.]+ tokens/s \(prompt: \d+ tokens in [\d.]+ s(; [\d.]+ tokens a verify step)?\) on "
    assert re.search(line + re.escape(out["path"]) + "$", streamed.stderr, re.MULTILINE), streamed.stderr  # on stderr


def test_same_seed_same_sample(tiny_model_dir):
    args = ["generate", "Hello", "--model", str(tiny_model_dir), "--temperature", "1", "--max-new-tokens", "12",
            "--ignore-eos", "--json"]
    a, b = quasar(*args, "--seed", "7"), quasar(*args, "--seed", "7")
    c = quasar(*args, "--seed", "8")
    ids = [json.loads(r.stdout)["token_ids"] for r in (a, b, c)]
    assert ids[0] == ids[1]
    assert ids[0] != ids[2]


@pytest.mark.parametrize(
    "args,match",
    [
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
    ],
)
def test_invalid_sampling_values(args, match, tiny_model_dir):
    assert_clean_error(quasar("generate", "hi", "--model", str(tiny_model_dir), *args), match)


def test_bad_model_paths(tmp_path, tiny_model_dir):
    assert_clean_error(quasar("generate", "hi", "--model", str(tmp_path / "missing")), "does not exist")
    assert_clean_error(quasar("generate", "hi", "--model", str(tmp_path)), "without config.json")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    assert_clean_error(quasar("generate", "hi", "--model", str(broken)), "safetensors")
    bad_gguf = tmp_path / "bad.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    assert_clean_error(quasar("generate", "hi", "--model", str(bad_gguf)), "GGUF")


def test_prompt_longer_than_context(tiny_model_dir):
    result = quasar("generate", "word " * 100, "--model", str(tiny_model_dir), "--max-context", "32", "--no-chat")
    assert_clean_error(result, "context window")


def run_main(capsys, *argv: str) -> tuple[int, str]:
    """`quasar ARGV` in this process: (exit code, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, match: str) -> None:
    assert code in (1, 2), err
    assert err.startswith("quasar: error: ") and match in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args,match", [
    (["--seed", str(2**64)], "seed"),
    (["--seed", str(-(2**63) - 1)], "seed"),
    (["--max-context", "0"], "--max-context"),
    (["--max-context", "-3"], "--max-context"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "many"], "--max-new-tokens"),
    (["--top-k", "-1"], "--top-k"),
    (["--min-p", "1.5"], "--min-p"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--drafter", "ngrma"], "--drafter"),
    (["--verifier", "w8a9"], "--verifier"),
    (["--ngram-min", "0"], "--ngram-min"),
    (["--ngram-max", "0"], "--ngram-max"),
    (["--k", "0"], "--k"),
    (["--exact", "--verifier", "bf16"], "--exact"),
    (["--exact", "--verifier", "w8a8+bf16"], "--exact"),
    (["--guard", "-1"], "guard margin"),
])
def test_bad_generate_numbers_are_refused_before_the_model_loads(capsys, tmp_path, args, match):
    """The model path does not exist: a check made after loading would report that instead."""
    code, err = run_main(capsys, "generate", "hi", "--model", str(tmp_path / "missing"), *args)
    assert_one_line_error(code, err, match)
    assert "does not exist" not in err


@pytest.mark.parametrize("argv,match", [
    (["bench", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["bench", "--limit", "0"], "--limit"),
    (["bench", "--max-context", "0"], "--max-context"),
    (["bench", "--seed", str(2**64)], "--seed"),
    (["bench", "--temperatures", "0,-1"], "--temperatures"),
    (["eval", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["eval", "--limit", "0"], "--limit"),
    (["eval", "--timeout", "0"], "--timeout"),
    (["eval", "--max-context", "0"], "--max-context"),
    (["serve", "--max-context", "0"], "--max-context"),
    (["serve", "--port", "65536"], "--port"),
    (["serve", "--max-queue", "0"], "--max-queue"),
    (["quantize", "--out", "x", "--calib-samples", "0"], "--calib-samples"),
])
def test_bad_numbers_of_other_commands_are_refused_while_parsing(capsys, monkeypatch, argv, match):
    import importlib

    def must_not_run(args):
        raise AssertionError(f"{argv[0]} ran with {argv[1:]}")

    monkeypatch.setattr(importlib.import_module(f"quasar.commands.{argv[0]}"), "run", must_not_run)
    assert_one_line_error(*run_main(capsys, *argv), match)


def test_oversized_seed_in_a_real_process_is_one_line(tmp_path):
    result = quasar("generate", "--seed", str(2**64), "hi", "--model", str(tmp_path / "missing"))
    assert_clean_error(result, "seed")
    assert "does not exist" not in result.stderr


def test_unexpected_errors_are_one_line_and_v_shows_the_traceback(capsys, monkeypatch):
    from quasar.commands import models

    def broken(args):
        raise RuntimeError("registry exploded\nsecond line")

    monkeypatch.setattr(models, "run_list", broken)
    code, err = run_main(capsys, "models", "list")
    assert_one_line_error(code, err, "RuntimeError: registry exploded")
    assert "-v" in err
    with pytest.raises(RuntimeError, match="registry exploded"):
        main(["-v", "models", "list"])


@pytest.mark.parametrize("args,match", [
    (["--regex", "(ab"], "--regex"),
    (["--json-schema", '{"type": "strin"}'], "--json-schema"),
    (["--json-schema", "{not json"], "--json-schema"),
    (["--grammar", "start: nowhere"], "--grammar"),
    (["--json-schema", "{}", "--regex", "a"], "not allowed with"),
])
def test_bad_structures_are_refused_before_the_model_loads(capsys, tmp_path, args, match):
    code, err = run_main(capsys, "generate", "hi", "--model", str(tmp_path / "missing"), *args)
    assert_one_line_error(code, err, match)
    assert "does not exist" not in err


def test_generate_answers_with_json_that_validates_against_a_schema_file(tiny_model_dir, tmp_path):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    result = quasar("generate", "Answer:", "--model", str(tiny_model_dir), "--json-schema",
                    str(tmp_path / "schema.json"), "--max-new-tokens", "32", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["finish_reason"] == "stop" and set(json.loads(out["text"])) == {"ok", "n"}
    assert out["stats"]["forced_tokens"] > 0  # the default drafter (ngram) drafted the keys for free


def test_chat_takes_a_json_schema_and_refuses_a_bad_one_while_parsing(capsys, tmp_path):
    code, err = run_main(capsys, "chat", "--model", str(tmp_path / "missing"), "--json-schema", '{"type": "strin"}')
    assert_one_line_error(code, err, "--json-schema")
    code, err = run_main(capsys, "chat", "--model", str(tmp_path / "missing"), "--regex", "a+")
    assert code == 2 and "--regex" in err  # chat takes a schema only
