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
        self.matcher = StopStrings(self.stop)
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
        if self.stop and not self.done:
            cut = self.matcher.feed(self.text[self.matcher.seen :])
            if cut is not None:
                self.text, self.done = self.text[:cut], True
        end = len(self.text) if (final or self.done) else len(self.text) - self.matcher.partial
        piece = self.text[self.released : end] if end > self.released else ""
        self.released += len(piece)
        return piece


class StopStrings:
    """Finds the first of several stop strings in a growing text, in time linear in the text: one Knuth-Morris-Pratt
    automaton per string, fed each character once. The first match is the one that ends first (the longest of
    those that end at the same character), so the cut does not depend on how the text was split into tokens."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.fallback = [failure_function(s) for s in stops]
        self.matched = [0] * len(stops)  # per string: the longest prefix of it that the text ends with
        self.seen = 0  # characters fed so far

    def feed(self, text: str) -> int | None:
        """Feed the next characters; where the first complete stop string starts (an index into all the text fed),
        or None."""
        for char in text:
            self.seen += 1
            first = None
            for i, (stop, fallback) in enumerate(zip(self.stops, self.fallback)):
                n = self.matched[i]
                while n and stop[n] != char:
                    n = fallback[n - 1]
                n += stop[n] == char
                if n == len(stop):
                    first = self.seen - n if first is None else min(first, self.seen - n)
                self.matched[i] = n
            if first is not None:
                return first
        return None

    @property
    def partial(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string: text held back."""
        return max(self.matched, default=0)


def failure_function(s: str) -> list[int]:
    """For each prefix of `s`, the length of its longest proper prefix that is also its suffix."""
    table = [0] * len(s)
    n = 0
    for i in range(1, len(s)):
        while n and s[i] != s[n]:
            n = table[n - 1]
        n += s[i] == s[n]
        table[i] = n
    return table
