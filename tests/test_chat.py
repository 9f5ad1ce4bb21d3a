"""`quasar chat` through a pseudo-terminal, and the conversation under it: a turn prefills only its own tokens,
Ctrl-C stops an answer and keeps the conversation, /reset, /stats, Ctrl-D leaves."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import sys
import time

from conftest import needs_kernels
from helpers import engine_for
from quasar.decoding.conversation import Conversation
from quasar.decoding.sampling import SamplingParams

TURN = re.compile(r"\[(stopped; )?(\d+) tokens, .*prompt: (\d+) new tokens \(\+(\d+) cached\)")


class Terminal:
    """A command run on a pseudo-terminal: what it writes is read until a pattern shows up."""

    def __init__(self, *argv: str) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the terminal is its stdin, stdout and stderr
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a suite started in the background ignores SIGINT
            os.execvp(argv[0], argv)
        self.seen = ""
        self.returncode: int | None = None

    def expect(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while (match := re.search(pattern, self.seen)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"no {pattern!r} within {timeout} s; the terminal shows:\n{self.seen[-3000:]}")
            try:
                chunk = os.read(self.fd, 65536).decode(errors="replace")
            except OSError:  # the child closed the terminal
                chunk = ""
            if not chunk:
                raise AssertionError(f"the command ended before {pattern!r}; the terminal shows:\n{self.seen[-3000:]}")
            self.seen += chunk
        self.seen = self.seen[match.end():]
        return match  # match.string: everything seen up to here

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                return self.returncode
            try:
                os.read(self.fd, 65536)
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError("the command did not exit")

    def close(self) -> None:
        """Kill the command if it still runs (a failed test), and release the terminal."""
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


@needs_kernels
def test_chat_on_a_terminal_keeps_the_kv_cache_across_turns_and_survives_ctrl_c(tiny_model_dir):
    chat = Terminal(sys.executable, "-m", "quasar", "chat", "--model", str(tiny_model_dir), "--verifier", "fp32",
                    "--max-new-tokens", "12", "--ignore-eos")
    try:
        chat.expect(r"> ")
        chat.send("Name three colours.\r")
        first = chat.expect(TURN.pattern)
        new_1, prefilled_1, cached_1 = int(first[2]), int(first[3]), int(first[4])
        assert cached_1 == 0 and new_1 == 12

        chat.expect(r"> ")
        chat.send("And three more?\r")
        second = chat.expect(TURN.pattern)
        prefilled_2, cached_2 = int(second[3]), int(second[4])
        # everything turn 1 read and wrote is reused but the reply's last token (written, never read)
        assert cached_2 == prefilled_1 + new_1 - 1
        assert 0 < prefilled_2 < 20  # the new turn's own tokens (its template's few) and that one token

        chat.expect(r"> ")
        chat.send("/stats\r")
        chat.expect(r"turns: 2; context: (\d+)")
        chat.expect(r"prompts: \d+ tokens processed, \d+ reused from the KV cache")

        chat.expect(r"> ")
        chat.send("/reset\r")
        chat.expect(r"conversation cleared")
        chat.expect(r"> ")
        chat.send("/stats\r")
        chat.expect(r"turns: 0; context: 0 of")

        chat.expect(r"> ")
        chat.send("/nonsense\r")
        chat.expect(r"unknown command /nonsense")

        chat.expect(r"> ")
        chat.send("\x04")  # Ctrl-D at the prompt leaves
        assert chat.wait() == 0
    finally:
        chat.close()


@needs_kernels
def test_ctrl_c_stops_the_answer_and_the_conversation_goes_on(default_model):
    chat = Terminal(sys.executable, "-m", "quasar", "chat", "--verifier", "bf16", "--drafter", "none",
                    "--max-new-tokens", "2000", "--ignore-eos")
    try:
        chat.expect(r"> ")
        chat.send("Tell me a long story.\r")
        chat.expect(r"long story\.\r\n")  # the echoed line
        chat.expect(r"[^\[]{40}")  # then some of the answer
        chat.send("\x03")  # Ctrl-C while it answers
        stopped = chat.expect(TURN.pattern)
        assert stopped[1] == "stopped; " and int(stopped[2]) < 2000, stopped.string
        chat.expect(r"> ")
        chat.send("/stats\r")
        chat.expect(r"turns: 1; context: (\d+)")
        chat.expect(r"> ")
        chat.send("Go on.\r")
        chat.expect(r"Go on\.\r\n")
        chat.expect(r"[^\[]{40}")
        chat.send("\x03")
        again = chat.expect(TURN.pattern)
        assert again[1] == "stopped; " and int(again[4]) > 0  # the interrupted turn was kept, and its cache reused
        chat.expect(r"> ")
        chat.send("/exit\r")
        assert chat.wait() == 0
    finally:
        chat.close()


@needs_kernels
def test_a_turn_prefills_only_its_own_tokens_and_answers_as_from_scratch():
    engine = engine_for("ngram+bf16")
    conversation = Conversation(engine, system="Be brief.")
    params = SamplingParams(max_new_tokens=12)
    first = conversation.send("Name three rivers in Europe.", params).result()
    read_and_written = first.prompt_token_ids + first.token_ids
    second = conversation.send("Which one is the longest?", params).result()
    assert second.prompt_token_ids[: len(read_and_written)] == read_and_written
    assert second.stats.cached_tokens == len(read_and_written) - 1  # all but the reply's last token, never read
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant", "user", "assistant"]
    engine.caches.free.clear()
    fresh = engine.generate(second.prompt_token_ids, params)
    assert fresh.stats.cached_tokens == 0 and fresh.token_ids == second.token_ids
    conversation.reset()
    assert conversation.ids == [] and [m["role"] for m in conversation.messages] == ["system"]
