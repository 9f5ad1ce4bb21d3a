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
