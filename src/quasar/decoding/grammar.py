"""Structured output: an answer held to a grammar (a JSON schema, any JSON object, a regular expression or a Lark
grammar), compiled and matched by llguidance (the grammar engine llama.cpp and vLLM use).

- `Constraint`: what a request asks for (its kind and text), compiled and checked where it is made, without a
  tokenizer, so that a bad schema is refused before anything runs.
- `Grammars`: one model's tokenizer bridged to llguidance (built once per engine, ~0.2 s for 49k tokens); it makes
  each request's `GrammarMask`.
- `GrammarMask`: a request's matcher. As a row processor (quasar.decoding.processors) it sets every token the
  grammar rejects at a row's position to -inf: row i is the position after the committed tokens and draft[:i], so
  each verify row is masked as plain decoding masks that position, and the output is the verifier's constrained
  distribution whatever the drafter proposed. For drafting it says which tokens the grammar forces next and how
  much of a draft it accepts.

JSON is held to one layout: `", "` between items, `": "` after keys, no other whitespace outside strings. A model
cannot then spend its tokens on whitespace (a small model can loop on newlines forever), and more of the answer is
forced: the keys, quotes and separators are drafted for free.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# llguidance computes some masks on a rayon thread pool of its own, one thread per core by default: on a few cores
# its threads, spinning between masks, take the cores from the forward's OpenMP threads (measured on 2 cores: the
# first structured answer 16 s instead of 0.7 s). One thread, unless the process says otherwise; set before
# llguidance builds its pool.
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import llguidance

KINDS = ("json_schema", "json_object", "regex", "grammar")  # as SamplingParams names them
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that cannot be used: `field` names what the request set (json_schema, regex, grammar, ...)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"invalid {field}: {reason}")
        self.field, self.reason = field, reason


def schema_text(schema: Any, what: str = "json_schema") -> str:
    """A JSON schema (a dict, a JSON text, or a pydantic model class) as JSON text; GrammarError unless it is a
    JSON object."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(what, f"not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise GrammarError(what, f"a JSON schema is a JSON object, got {type(schema).__name__}")
    return json.dumps(schema, ensure_ascii=False)


@functools.lru_cache(maxsize=64)  # the n choices of a request, and clients that send one schema again and again
def compile_grammar(kind: str, text: str) -> str:
    """llguidance's grammar for a constraint of `kind` (KINDS) with `text`; GrammarError naming the kind when
    llguidance refuses it (an unsupported schema keyword, an unclosed group, an unknown rule)."""
    if kind == "json_schema":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text(text), overrides=JSON_LAYOUT)
    elif kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(text)
    elif kind == "grammar":  # Lark, or llama.cpp's GBNF (converted to Lark)
        try:
            grammar = llguidance.grammar_from("grammar", text)
        except ValueError as e:
            raise GrammarError(kind, str(e).strip().splitlines()[0]) from None
    else:
        raise ValueError(f"unknown constraint kind {kind!r}; one of {', '.join(KINDS)}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(kind, error.strip().splitlines()[0])
    return grammar


@dataclass(frozen=True)
class Constraint:
    """What an answer must match: `kind` (KINDS) and its text (a JSON schema's JSON text, a regular expression, a
    Lark or GBNF grammar; empty for json_object; a schema given as a dict or a pydantic model class is kept as its
    JSON text). Compiled when made: a bad one raises GrammarError."""

    kind: str
    text: str = ""
    grammar: str = field(default="", init=False, repr=False, compare=False)  # llguidance's form

    def __post_init__(self) -> None:
        text = schema_text(self.text) if self.kind == "json_schema" else self.text
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "grammar", compile_grammar(self.kind, text))


class Grammars:
    """One model's tokenizer as llguidance sees it (`vocab_size`: the logits' width; `eos_ids`: the tokens that end
    an answer, allowed where the grammar is complete); makes each request's GrammarMask."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        """`tokenizer`: a Hugging Face fast tokenizer; its Rust tokenizer is what llguidance reads (as
        llguidance.hf.from_tokenizer does: a copy, without padding or truncation)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("structured output needs the model's fast (Rust) tokenizer")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))
        self.vocab_size, self.eos_ids = vocab_size, tuple(eos_ids)

    def mask(self, constraint: Constraint) -> GrammarMask:
        matcher = llguidance.LLMatcher(self.tokenizer, constraint.grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(constraint.kind, matcher.get_error().strip().splitlines()[0])
        return GrammarMask(matcher, self.vocab_size, self.eos_ids)


class GrammarMask:
    """One request's grammar state: the tokens it committed, matched; masks rows, forces tokens, judges drafts."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: Sequence[int] = ()) -> None:
        self.matcher = matcher
        self.eos = frozenset(eos_ids)  # a draft's EOS ends the answer: the rows after it are never emitted
        self.V = vocab_size
        self.words = (vocab_size + 31) // 32
        self.bits = torch.zeros(8, self.words, dtype=torch.int32)  # [R, V / 32] one bit per token, reused

    def apply(self, logits: torch.Tensor, history: Sequence[int], draft: Sequence[int]) -> None:
        """logits [R, V] in place: row i, the position after the committed tokens and draft[:i], keeps only the
        tokens the grammar allows there. Rows past a draft token the grammar rejects are left as they are: that
        token is masked out of the row before, so it is never accepted and the rows after it are never read. So are
        the rows past a draft's EOS: the answer ends there, whatever they hold."""
        R = logits.shape[0]
        valid = list(draft[: self.valid(draft[: R - 1])])
        reached = 1 + next((j for j, token in enumerate(valid) if token in self.eos), len(valid))  # rows masked
        if self.bits.shape[0] < reached:
            self.bits = torch.zeros(reached, self.words, dtype=torch.int32)
        for i in range(reached):
            if i:
                self.consume(draft[i - 1 : i])
            self.matcher.unsafe_compute_mask_ptr(self.bits[i].data_ptr(), self.words * 4)
        if reached > 1:
            self.matcher.rollback(reached - 1)
        bits = np.unpackbits(self.bits[:reached].numpy().view(np.uint8), axis=1, count=self.V, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)  # [reached, V] (bytes of 0 or 1)
        logits[:reached].masked_fill_(allowed.logical_not_(), float("-inf"))

    def commit(self, tokens: Sequence[int]) -> None:
        """The tokens a step emitted (each one allowed by its row's mask)."""
        self.consume(tokens)

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance over tokens the grammar accepts, one at a time (llguidance takes a last EOS only so, and never
        rolls one back: only committed tokens may hold an EOS)."""
        for token in tokens:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar rejected token {token}: {self.matcher.get_error()}")

    def valid(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar accepts in a row from where it is (an EOS where the answer is whole
        counts, and ends the run)."""
        n = self.matcher.validate_tokens(list(tokens))
        ended = any(token in self.eos for token in tokens[:n])
        if n < len(tokens) and tokens[n] in self.eos and not ended:  # llguidance's validation stops at an end it takes
            self.consume(tokens[:n])
            whole = self.matcher.is_accepting()
            if n:
                self.matcher.rollback(n)
            n += whole
        return n

    def forced(self, after: Sequence[int] = ()) -> list[int]:
        """The tokens the grammar forces after the committed tokens and `after` (a prefix it accepts): the
        canonical tokens of the text only it allows next (llguidance's fast-forward tokens); none past an EOS."""
        if any(token in self.eos for token in after):
            return []
        self.consume(after)
        tokens = self.matcher.compute_ff_tokens()
        if after:
            self.matcher.rollback(len(after))
        return tokens

    def accepted(self, tokens: Sequence[int], after: Sequence[int] = ()) -> int:
        """How many of `tokens` the grammar accepts in a row, after the committed tokens and `after` (a prefix it
        accepts; nothing past an EOS)."""
        if any(token in self.eos for token in after):
            return 0
        self.consume(after)
        n = self.valid(tokens)
        if after:
            self.matcher.rollback(len(after))
        return n

    @property
    def done(self) -> bool:
        """Whether the grammar allows nothing more but the end of the answer."""
        return self.matcher.is_stopped()


class Bridges:
    """The Grammars of each tokenizer in use, built on its first grammar and kept while the tokenizer lives."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.made: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], Grammars]] = (
            weakref.WeakKeyDictionary()
        )

    def __call__(self, vocab: Any) -> Grammars:
        """The Grammars of a quasar.decoding.rules.Vocab (its tokenizer, size and EOS ids)."""
        if vocab.tokenizer is None:
            raise ValueError("a grammar needs the model's tokenizer")
        key = (vocab.size, tuple(vocab.eos))
        with self.lock:
            kept = self.made.setdefault(vocab.tokenizer, {})
            if key not in kept:
                kept[key] = Grammars(vocab.tokenizer, vocab.size, vocab.eos)
            return kept[key]


grammars_for = Bridges()
