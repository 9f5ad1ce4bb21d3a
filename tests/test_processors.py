"""Row processors (quasar.decoding.processors): every row a token is picked from passes through a request's
processors as plain decoding would process that position, so greedy speculative == greedy plain under any processor,
and a batch gives each request what it gets alone."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import pytest
import torch
from helpers import decoder_for
from test_speculative import one_thread  # noqa: F401 (a fixture)

from quasar.decoding import processors
from quasar.decoding.batch import Batch
from quasar.decoding.drafters.base import Draft
from quasar.decoding.engine import Engine
from quasar.decoding.sampling import SamplingParams
from quasar.decoding.speculative import Speculative

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: thread syncs would cost more than they save
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9, 7, 8, 9, 7], [5, 6, 5, 6, 5, 6, 5, 6]]


class Ban:
    """Bans one token everywhere."""

    def __init__(self, token: int) -> None:
        self.token = token

    def apply(self, logits: torch.Tensor, history: Sequence[int], draft: Sequence[int]) -> None:
        logits[:, self.token] = -float("inf")

    def commit(self, tokens: Sequence[int]) -> None:
        pass


class NoRepeat:
    """Bans the token before each row's position (history + draft[:i]), and checks that commits follow history."""

    def __init__(self) -> None:
        self.committed: list[int] = []

    def apply(self, logits: torch.Tensor, history: Sequence[int], draft: Sequence[int]) -> None:
        assert list(history[len(history) - len(self.committed) :]) == self.committed
        for i in range(len(logits)):
            logits[i, [*history, *draft[:i]][-1]] = -float("inf")

    def commit(self, tokens: Sequence[int]) -> None:
        self.committed.extend(tokens)


class Oracle:
    """A drafter that knows the answers (prompt -> tokens): it drafts what follows, wrong from its third token on
    every other step, so that verify steps accept whole drafts and reject inside them."""

    free = False  # it drafts every step

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab_size: int) -> None:
        self.answers, self.vocab_size = answers, vocab_size
        self.reset()

    def spawn(self) -> Oracle:
        return Oracle(self.answers, self.vocab_size)

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.steps = 0

    def commit(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def rewind(self, n: int) -> None:
        del self.tokens[len(self.tokens) - n :]

    def propose(self, k: int, params, generator) -> Draft:
        prompt = next(p for p in self.answers if tuple(self.tokens[: len(p)]) == p)
        done = len(self.tokens) - len(prompt)
        draft = list(self.answers[prompt][done : done + k])
        self.steps += 1
        if self.steps % 2 and len(draft) > 2:
            draft[2] = (draft[2] + 1) % self.vocab_size
        return Draft(draft)


def oracle_engine(model, answers: list[list[int]]) -> Engine:
    """An engine whose speculative decoder drafts `answers` (one per prompt of PROMPTS) with an Oracle, k = 4."""
    oracle = Oracle({tuple(p): a for p, a in zip(PROMPTS, answers)}, model.model.config.vocab_size)
    return Engine(model, Speculative(oracle, k=4))


@pytest.fixture
def with_processor(monkeypatch):
    """Makes every request carry the processor `make()` gives (a factory in processors.FACTORIES)."""

    def use(make) -> None:
        monkeypatch.setattr(processors, "FACTORIES", [lambda params, vocab: make()])

    return use


def generate(engine: Engine, params: SamplingParams) -> list[list[int]]:
    return [engine.generate(ids, params).token_ids for ids in PROMPTS]


def test_a_banned_token_is_never_emitted_and_speculative_equals_plain(tiny_model, with_processor):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain, speculative = Engine(tiny_model), Engine(tiny_model, decoder_for("ngram", tiny_model, k=4))
    free = generate(plain, params)
    banned = max(set(free[0]), key=free[0].count)  # the token the model emits most: the ban changes the output
    with_processor(lambda: Ban(banned))
    want = generate(plain, params)
    assert want != free and all(banned not in tokens for tokens in want)
    assert generate(speculative, params) == want


def test_each_verify_row_is_processed_after_its_own_draft_prefix(tiny_model, with_processor):
    """A processor that depends on the tokens before each row: greedy speculative (with drafts accepted) stays
    plain token for token, and a batch gives each request its tokens alone."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = Engine(tiny_model)
    with_processor(NoRepeat)
    want = generate(plain, params)
    assert all(a != b for tokens in want for a, b in pairwise(tokens))
    for speculative in (Engine(tiny_model, decoder_for("ngram", tiny_model, k=4)), oracle_engine(tiny_model, want)):
        outputs = [speculative.generate(ids, params) for ids in PROMPTS]
        assert [out.token_ids for out in outputs] == want
        requests = [speculative.request(ids, params) for ids in PROMPTS]
        Batch(speculative).run_all(requests)
        assert [r.output.token_ids for r in requests] == want
    stats = [out.stats for out in outputs]  # the oracle's: whole drafts accepted, and drafts rejected inside
    assert sum(s.accepted_tokens for s in stats) > len(stats) * 8 and sum(s.proposed_tokens for s in stats) > sum(
        s.accepted_tokens for s in stats
    )


def test_a_banned_token_is_never_a_top_logprob():
    from quasar.decoding.processors import token_logprobs

    rows = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])  # [1, V]: two tokens banned
    [entry] = token_logprobs(rows, [2], top=4)
    assert [token for token, _ in entry.top] == [2, 0]
