"""Token ids -> text pieces that are valid UTF-8, with stop strings held back until they resolve."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces (the prefix/read offset scheme of vLLM).

    A piece is released only when it does not end in a partial UTF-8 character and cannot be the
    start of a stop string; `done` turns true once a stop string appears (the text ends before it).
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.prefix = self.read = 0  # token offsets: decode context start, end of decoded text
        self.text = ""  # all decoded text so far (stop string excluded once found)
        self.released = 0  # characters of text already handed out
        self.done = False

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, tokens: list[int]) -> str:
        """Append tokens; return the newly releasable text ('' if none yet)."""
        if self.done:
            return ""
        self.ids.extend(tokens)
        before = self.decode(self.ids[self.prefix : self.read])
        after = self.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        return self.release(final=False)

    def finish(self) -> str:
        """The stream ended: flush whatever is held back."""
        if not self.done:
            tail = self.decode(self.ids[self.prefix :])[len(self.decode(self.ids[self.prefix : self.read])) :]
            self.text += tail.rstrip("\ufffd")
        return self.release(final=True)

    def release(self, final: bool) -> str:
        hits = [i for i in (self.text.find(s, max(0, self.released - len(s))) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.done = self.text[: min(hits)], True
        end = len(self.text) if (final or self.done) else len(self.text) - self.held_back()
        piece = self.text[self.released : end] if end > self.released else ""
        self.released += len(piece)
        return piece

    def held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
