"""Streaming text pieces: valid UTF-8 only, stop strings cut and held back."""

from __future__ import annotations

import pytest

from quasar.decoding.detokenize import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model.tokenizer


def stream(tokenizer, ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = [detok.add([i]) for i in ids] + [detok.finish()]
    return [p for p in pieces if p], detok


def test_pieces_are_valid_utf8_and_join_to_the_full_text(tokenizer):
    text = "Café ☕ costs 3€ — naïve 日本語 emoji 🚀🎉 done."
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, detok = stream(tokenizer, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == detok.text
    assert len(pieces) > 5  # it streams, not one blob at the end


def test_stop_string_cuts_and_is_never_emitted(tokenizer):
    ids = tokenizer.encode("Answer: 42\n\nUser: next question", add_special_tokens=False)
    pieces, detok = stream(tokenizer, ids, stop=("\n\nUser:",))
    assert "".join(pieces) == "Answer: 42"
    assert detok.done
    assert not any("\n" in p for p in pieces)  # the stop string's start was held back, not streamed


def test_partial_stop_prefix_is_released_at_the_end(tokenizer):
    ids = tokenizer.encode("Hello world\n\nUs", add_special_tokens=False)
    pieces, detok = stream(tokenizer, ids, stop=("\n\nUser:",))
    assert "".join(pieces) == "Hello world\n\nUs" and not detok.done


class Chars:
    """A tokenizer whose token ids are characters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def cut_by_brute_force(text: str, stops: tuple[str, ...]) -> str:
    """The text before the stop string that ends first (the longest of those that end at the same character)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if starts:
            return text[: min(starts)]
    return text


def test_the_first_stop_string_to_end_cuts_however_the_text_is_split_into_tokens():
    import random

    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        stops = tuple("".join(rng.choice("abc") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3)))
        expected = cut_by_brute_force(text, stops)
        for _ in range(3):  # the same text in different token splits
            detok, pieces, i = IncrementalDetokenizer(Chars(), stops), [], 0
            while i < len(text):
                n = rng.randint(1, 6)
                pieces.append(detok.add([ord(c) for c in text[i : i + n]]))
                i += n
            pieces.append(detok.finish())
            assert "".join(pieces) == expected, (text, stops)
            assert detok.done == (expected != text)


def test_long_stop_strings_hold_back_exactly_their_longest_partial_match():
    detok = IncrementalDetokenizer(Chars(), ("x" * 200 + "y", "ab" * 100 + "c"))
    released = detok.add([ord(c) for c in "start " + "x" * 150])
    assert released == "start "  # the x's may begin the first stop string
    released += detok.add([ord(c) for c in "x" * 60 + "z"])
    assert released == "start " + "x" * 210 + "z" and not detok.done
    released += detok.add([ord(c) for c in "ab" * 100 + "c tail"])
    assert released == "start " + "x" * 210 + "z" and detok.done
