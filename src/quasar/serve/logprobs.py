"""Token logprobs (quasar.decoding.processors.TokenLogprob) as the OpenAI API writes them: a chat choice's
`logprobs.content`, a completion choice's `logprobs` {tokens, token_logprobs, top_logprobs, text_offset}."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quasar.decoding.processors import TokenLogprob

FLOOR = -9999.0  # the logprob written for a token a rule banned (-inf), as OpenAI writes it: JSON has no infinity


def byte_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte (printable bytes stand for
    themselves, the others are shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


class TokenTexts:
    """Each token id's bytes, read once from the tokenizer's vocabulary (so that the HTTP side never calls the
    engine's tokenizer): a byte-level BPE vocabulary (one whose symbols include GPT-2's 'Ġ', a space) through
    GPT-2's alphabet; otherwise SentencePiece's '▁' as a space and <0xNN> as its byte; anything else (special
    tokens among them) as its UTF-8 text."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        pieces = [p or "" for p in tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))]
        table = byte_table() if any(p.startswith("\u0120") for p in pieces) else {}
        self.bytes = [self.read(p, table) for p in pieces] + [b""] * max(0, vocab_size - len(pieces))

    @staticmethod
    def read(piece: str, table: dict[str, int]) -> bytes:
        if table and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def text(self, token: int) -> str:
        return self.bytes[token].decode("utf-8", errors="replace")


def value(logprob: float) -> float:
    return max(logprob, FLOOR)


def chat_logprobs(logprobs: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """A chat choice's (or delta's) `logprobs`: {content: [{token, logprob, bytes, top_logprobs}], refusal}."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": texts.text(token), "logprob": value(logprob), "bytes": list(texts.bytes[token])}

    content = [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: Sequence[TokenLogprob], texts: TokenTexts, offset: int = 0) -> dict[str, Any]:
    """A completion choice's (or chunk's) `logprobs`; text_offset counts characters from `offset` (where these
    tokens' text starts in the completion)."""
    tokens = [texts.text(lp.token) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [value(lp.logprob) for lp in logprobs],
        "top_logprobs": [{texts.text(t): value(v) for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }
