"""The native llama-bench anchor: the command it runs and what it reads from llama-bench's JSON (a stand-in
executable prints what llama.cpp's and ik_llama.cpp's builds print; neither is built here)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from quasar.tools.bench.llama_bench import LlamaBench, LlamaBenchError

TESTS = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 76.9, "repack": True},
         {"n_prompt": 6, "n_gen": 0, "avg_ts": 69.0, "repack": True},
         {"n_prompt": 0, "n_gen": 64, "avg_ts": 21.4, "repack": True}]


def stand_in(tmp_path: Path, output: str, code: int = 0) -> Path:
    """An executable that records its arguments and prints `output`."""
    path = tmp_path / "llama-bench"
    path.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv'}\ncat <<'END'\n{output}\nEND\nexit {code}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_one_run_gives_prefill_rate_and_step_times(tmp_path):
    exe = stand_in(tmp_path, "build: 1234 (abc)\n" + json.dumps(TESTS))
    anchor = LlamaBench(f"{exe} -rtr 1").run(Path("model.gguf"), threads=2, prompt_len=512, rows=6, rounds=3)
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:2] == ["-rtr", "1"] and "-o" in argv and argv[argv.index("-p") + 1] == "512,6"
    assert argv[argv.index("-m") + 1] == "model.gguf" and argv[argv.index("-t") + 1] == "2"
    assert anchor.prefill_tok_s == 76.9
    assert anchor.decode_ms == pytest.approx(1e3 / 21.4) and anchor.verify_ms == pytest.approx(6e3 / 69.0)


@pytest.mark.parametrize("output,code,match", [
    ("[]", 0, "no rate"),
    ("error: failed to load model", 1, "exited with 1: error: failed to load model"),
    ("not json [", 0, "no JSON"),
])
def test_a_failed_or_unreadable_run_says_why(tmp_path, output, code, match):
    exe = stand_in(tmp_path, output, code)
    with pytest.raises(LlamaBenchError, match=match):
        LlamaBench(str(exe)).run(Path("m.gguf"), threads=2, prompt_len=512, rows=6, rounds=1)


def test_a_missing_executable_is_named():
    with pytest.raises(FileNotFoundError, match="no llama-bench at /nowhere/llama-bench"):
        LlamaBench("/nowhere/llama-bench")
