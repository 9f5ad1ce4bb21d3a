"""SIGKILL in the middle of every command that writes: `quasar quantize` (the GGUF conversion into the cache, then
the checkpoint), `quasar bench` and `quasar eval`. After each kill, every cache entry and output is complete (it
loads or parses) or absent, never half-written; the re-run succeeds.

Each command runs in a child process. A kill must land while a write is in progress, so the child either stalls
in its n-th safetensors write (after cutting the file to half its size, as a kill halfway through would leave
it), or the test watches the file system for the first output and kills at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from helpers import cache_at, run_cli, share_kernels

from quasar.model.loading import load
from quasar.quant.checkpoint import load_quantized

KILL_WAIT_S = 120  # the longest a child may take to reach the moment it is killed

# quasar's CLI, stalled in its argv[1]-th call of safetensors.torch.save_file (never when 0)
CHILD = """
import itertools, os, sys, time
from pathlib import Path
import safetensors.torch

stall_at, marker, argv = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
real_save_file, calls = safetensors.torch.save_file, itertools.count(1)

def save_file_then_stall(tensors, filename, metadata=None):
    real_save_file(tensors, filename, metadata)
    if next(calls) == stall_at:
        os.truncate(filename, os.path.getsize(filename) // 2)
        marker.with_suffix(".tmp").write_text(str(filename))
        marker.with_suffix(".tmp").rename(marker)
        time.sleep(600)

safetensors.torch.save_file = save_file_then_stall
from quasar.cli import main
sys.exit(main(argv))
"""


def kill_when(tmp_path: Path, argv: list[str], moment: Callable[[], bool], stall_at: int = 0) -> Path | None:
    """Run `quasar argv`, SIGKILL it as soon as moment() holds or it stalls; return the stalled write's path."""
    marker, log = tmp_path / "stalled-in", tmp_path / "child.log"
    marker.unlink(missing_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(stall_at), str(marker), *argv], stdout=out, stderr=out
        )
    deadline = time.monotonic() + KILL_WAIT_S
    try:
        while not (marker.exists() or moment()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"quasar {argv[0]} was not killed mid-run (exit {proc.returncode}):\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return Path(marker.read_text()) if marker.exists() else None


def quasar(*argv: str) -> None:
    proc = run_cli(*argv, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def visible(folder: Path) -> list[str]:
    """The entries a reader sees; temporary siblings (`.NAME.tmp.*`) are hidden."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.exists() else []


# ---- quantize: the GGUF conversion, then the checkpoint --------------------------------------------------


def byte_alphabet() -> list[str]:
    """The 256 characters of GPT-2's byte-level alphabet: printable bytes as themselves, the others as chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def write_tiny_gguf(
    path: Path, hidden: int = 64, ff: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2
) -> Path:
    """A float32 llama GGUF with a 259-token byte-level tokenizer: converts and quantizes in about a second."""
    tokens = [*byte_alphabet(), "Ġt", "he", "<|endoftext|>"]
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    kv = kv_heads * hidden // heads
    shapes = {"token_embd": (len(tokens), hidden), "output": (len(tokens), hidden), "output_norm": (hidden,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm": (hidden,),
            f"blk.{i}.ffn_norm": (hidden,),
            f"blk.{i}.attn_q": (hidden, hidden),
            f"blk.{i}.attn_k": (kv, hidden),
            f"blk.{i}.attn_v": (kv, hidden),
            f"blk.{i}.attn_output": (hidden, hidden),
            f"blk.{i}.ffn_gate": (ff, hidden),
            f"blk.{i}.ffn_up": (ff, hidden),
            f"blk.{i}.ffn_down": (hidden, ff),
        }
    for name, shape in shapes.items():
        norm = len(shape) == 1
        writer.add_tensor(
            f"{name}.weight", np.ones(shape, np.float32) if norm else rng.normal(0, 0.05, shape).astype(np.float32)
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def fresh_cache(tmp_path) -> Path:
    """An empty --cache-dir, but for the compiled kernels, shared with the user cache so nothing recompiles."""
    return share_kernels(tmp_path / "cache")


def test_quantize_killed_while_converting_and_while_saving(tmp_path, fresh_cache):
    gguf, out, conversions = write_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "q", fresh_cache / "gguf"
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog, again and again.")
    paths = ["--model", str(gguf), "--cache-dir", str(fresh_cache), "--out", str(out), "--calib", str(calib)]
    argv = ["quantize", *paths, "--alpha", "0.5", "--calib-samples", "1", "--seq-len", "8"]

    stalled = kill_when(tmp_path, argv, lambda: False, stall_at=1)  # converting the GGUF
    assert stalled is not None and stalled.is_relative_to(conversions)
    assert visible(conversions) == [] and not out.exists()  # the half-written conversion is nobody's cache entry

    stalled = kill_when(tmp_path, argv, lambda: False, stall_at=2)  # converting again, then saving the checkpoint
    assert stalled is not None and stalled.is_relative_to(tmp_path) and not stalled.is_relative_to(fresh_cache)
    assert not out.exists()  # the half-written checkpoint is not at --out
    [entry] = visible(conversions)  # the second run finished the conversion before it was killed
    with cache_at(fresh_cache):
        assert load(gguf, "fp32").directory == conversions / entry
    for memo in (fresh_cache / "sha256").glob("*"):
        json.loads(memo.read_text())

    quasar(*argv)
    assert load_quantized(out).model.config.vocab_size == 259  # loads, and its weights match their recorded sha256
    assert visible(conversions) == [entry]


# ---- bench and eval --------------------------------------------------------------------------------------


def answer_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bench_killed_mid_run_keeps_the_earlier_run(tiny_model_dir, tmp_path):
    out = tmp_path / "bench"
    out.mkdir()
    earlier = {"answers.jsonl": '{"question_id": "earlier"}\n', "summary.json": "{}", "summary.md": "# earlier\n"}
    for name, text in earlier.items():
        (out / name).write_text(text)
    options = (
        "--methods ar:fp32 --categories writing,roleplay,math,stem --max-new-tokens 16 --no-memory-wall --no-plots"
    )
    argv = ["bench", "--model", str(tiny_model_dir), "--out", str(out), "--overwrite", *options.split()]

    def first_answer_written() -> bool:  # wherever the run writes its answers: --out or a temporary sibling
        return any('"mt-' in p.read_text() for p in tmp_path.glob("*/answers.jsonl"))

    kill_when(tmp_path, argv, first_answer_written)
    assert {p.name: p.read_text() for p in out.iterdir()} == earlier  # the earlier run, whole
    [partial] = tmp_path.glob(".bench.tmp.*")  # the killed run's answers, kept aside
    assert len(answer_lines(partial / "answers.jsonl")) >= 1 and not (partial / "summary.json").exists()

    quasar(*argv)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["prompts"] == 4 and not summary["config"]["interrupted"]
    assert [r["question_id"] for r in answer_lines(out / "answers.jsonl")] == ["mt-81", "mt-91", "mt-111", "mt-141"]
    assert sorted(p.name for p in out.iterdir()) == ["answers.jsonl", "summary.json", "summary.md"]


def test_eval_killed_mid_run_keeps_a_whole_report(tiny_model_dir, tmp_path):
    report = tmp_path / "report.json"
    report.write_text('{"earlier": "report"}')
    options = "--tasks mmlu,gsm8k --limit 3 --max-new-tokens 16 --overwrite"
    argv = ["eval", "--model", str(tiny_model_dir), "--out", str(report), *options.split()]

    kill_when(tmp_path, argv, lambda: report.read_text() != '{"earlier": "report"}')  # replaced after mmlu
    partial = json.loads(report.read_text())
    assert [(r["task"], r["n"]) for r in partial["rows"]] == [("mmlu", 3)]  # gsm8k was running when it was killed

    quasar(*argv)
    assert [(r["task"], r["n"]) for r in json.loads(report.read_text())["rows"]] == [("mmlu", 3), ("gsm8k", 3)]
