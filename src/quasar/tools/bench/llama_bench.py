"""A native `llama-bench` (llama.cpp's or ik_llama.cpp's build, never built by quasar) run on the model's own GGUF as
an anchor beside quasar's forwards: prompt tokens per second, a one-row step and a verify-sized step.

    LlamaBench("/opt/ik_llama.cpp/build/bin/llama-bench -rtr 1").run(gguf, threads=2, prompt_len=512, rows=6,
                                                                     rounds=3)

One call runs `-p PROMPT_LEN,ROWS -n 64` with flash attention off and reads its JSON: the prompt test gives the
prefill rate, the ROWS-token prompt test the step of ROWS rows (from an empty context, where quasar's steps run at
PROMPT_LEN cached tokens), and the 64-token generation test the one-row step.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

GENERATED = 64  # tokens of the generation test: its mean step is the one-row step


class LlamaBenchError(RuntimeError):
    """The llama-bench command failed or printed no result it could be read from."""


@dataclass(frozen=True)
class Anchor:
    name: str  # the command as given
    prefill_tok_s: float
    decode_ms: float  # one row
    verify_ms: float  # `rows` rows
    rows: int


class LlamaBench:
    def __init__(self, command: str) -> None:
        """`command`: the llama-bench executable and any arguments of its own (e.g. `-rtr 1`), as a shell would split
        them."""
        self.command = command
        self.argv = shlex.split(command)
        if not self.argv:
            raise ValueError("the llama-bench command is empty")
        if not Path(self.argv[0]).is_file():
            raise FileNotFoundError(f"no llama-bench at {self.argv[0]}")

    def run(self, gguf: Path, threads: int, prompt_len: int, rows: int, rounds: int, timeout: float = 3600) -> Anchor:
        argv = [*self.argv, "-m", str(gguf), "-t", str(threads), "-fa", "0", "-p", f"{prompt_len},{rows}",
                "-n", str(GENERATED), "-r", str(rounds), "-o", "json"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise LlamaBenchError(f"{self.command} ran past {timeout:.0f} s") from e
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise LlamaBenchError(f"{self.command} exited with {done.returncode}: {' / '.join(tail)}")
        return self.read(done.stdout, prompt_len, rows)

    def read(self, output: str, prompt_len: int, rows: int) -> Anchor:
        """The anchor from llama-bench's JSON output (a list of tests with n_prompt, n_gen and avg_ts)."""
        start = output.find("[")
        try:
            tests = json.loads(output[start:]) if start >= 0 else None
        except json.JSONDecodeError as e:
            raise LlamaBenchError(f"{self.command} printed no JSON result: {e}") from e
        if not isinstance(tests, list):
            raise LlamaBenchError(f"{self.command} printed no JSON list of tests")
        rates = {(int(t["n_prompt"]), int(t["n_gen"])): float(t["avg_ts"]) for t in tests}
        missing = [key for key in ((prompt_len, 0), (rows, 0), (0, GENERATED)) if not rates.get(key)]
        if missing:
            raise LlamaBenchError(f"{self.command} reported no rate for the tests (prompt, generated) {missing}")
        return Anchor(self.command, rates[(prompt_len, 0)], 1e3 / rates[(0, GENERATED)], 1e3 * rows / rates[(rows, 0)],
                      rows)
