"""The per-request logit rules (quasar.decoding.rules) and logprobs: each rule's formula; greedy speculative ==
greedy plain and batched == alone under every rule; at T > 0 speculative sampling follows the processed
distribution; logprobs are the same numbers whether a token came from a draft or not."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import decoder_for, drive
from test_processors import PROMPTS, oracle_engine
from test_speculative import DRAFTERS, PROMPT, V, one_thread, small_model  # noqa: F401 (one_thread: a fixture)
from test_verify import chi_square_p

from quasar.decoding import processors
from quasar.decoding.autoregressive import StopRule
from quasar.decoding.batch import Batch
from quasar.decoding.engine import Engine
from quasar.decoding.processors import Processing, Vocab, processors_for
from quasar.decoding.rules import Penalties
from quasar.decoding.sampling import SamplingParams, logits_to_probs
from quasar.decoding.speculative import Speculative
from quasar.decoding.stats import GenerationStats

BASE = SamplingParams(max_new_tokens=24)
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: thread syncs would cost more than they save


@pytest.fixture(scope="module")
def engines(tiny_model):
    """(plain, speculative with n-gram drafts of 4) on the tiny model, and the plain greedy outputs without rules."""
    plain, speculative = Engine(tiny_model), Engine(tiny_model, decoder_for("ngram", tiny_model, k=4))
    return plain, speculative, [plain.generate(ids, BASE) for ids in PROMPTS]


def rules(free: list[list[int]]) -> dict[str, dict]:
    """Each rule with values that change the tiny model's greedy output (`free`: its outputs without rules)."""
    common = max(set(free[0]), key=free[0].count)
    return {
        "logit_bias": {"logit_bias": {common: -100.0, free[1][3]: 5.0}},
        "presence_penalty": {"presence_penalty": 0.1},  # about the gaps between the tiny model's top logits
        "frequency_penalty": {"frequency_penalty": 0.05},
        "repetition_penalty": {"repetition_penalty": 2.0},
        "min_tokens": {"min_tokens": 6, "logit_bias": {2: 100.0}},  # EOS (2) the argmax, banned for 6 tokens
        "stop_token_ids": {"stop_token_ids": (free[0][5], free[2][4])},
        "all": {
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.3,
            "logit_bias": {common: -5.0},
            "min_tokens": 3,
        },
    }


@pytest.mark.parametrize(
    "rule",
    [
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "stop_token_ids",
        "all",
    ],
)
def test_greedy_speculative_equals_plain_and_batched_equals_alone_under_each_rule(engines, rule):
    plain, ngram, free = engines
    params = dataclasses.replace(BASE, **rules([out.token_ids for out in free])[rule])
    want = [plain.generate(ids, params) for ids in PROMPTS]
    assert [w.token_ids for w in want] != [f.token_ids for f in free]  # the rule changed the output
    oracle = oracle_engine(plain.target, [w.token_ids for w in want])  # drafts accepted in whole and in part
    for speculative in (ngram, oracle):
        got = [speculative.generate(ids, params) for ids in PROMPTS]
        assert [(g.token_ids, g.text, g.finish_reason) for g in got] == [
            (w.token_ids, w.text, w.finish_reason) for w in want
        ]
        requests = [speculative.request(ids, params) for ids in PROMPTS]
        Batch(speculative).run_all(requests)
        assert [r.output.token_ids for r in requests] == [w.token_ids for w in want]
    assert sum(g.stats.accepted_tokens for g in got) > 0  # the oracle's drafts were judged under the rule


def test_min_tokens_holds_eos_back_and_stop_token_ids_end_the_output_without_their_text(engines, tiny_model):
    plain, speculative, free = engines
    eos_first = dataclasses.replace(BASE, logit_bias={2: 100.0})  # EOS (2) the argmax everywhere
    assert plain.generate(PROMPTS[0], eos_first).token_ids == [2]
    held = plain.generate(PROMPTS[0], dataclasses.replace(eos_first, min_tokens=6))
    assert len(held.token_ids) == 7 and held.token_ids[-1] == 2 and 2 not in held.token_ids[:-1]
    tokens = free[0].token_ids
    stop = tokens[5]
    out = speculative.generate(PROMPTS[0], dataclasses.replace(BASE, stop_token_ids=(stop,), ignore_eos=True))
    assert out.token_ids == tokens[: tokens.index(stop) + 1] and out.finish_reason == "stop"
    assert out.text == tiny_model.tokenizer.decode(tokens[: tokens.index(stop)], skip_special_tokens=True)


def test_penalties_count_the_tokens_before_each_row():
    """Row i of a step is penalised for the generated tokens and draft[:i]; repetition also for the prompt's."""
    penalties = Penalties(presence=0.5, frequency=1.0, repetition=2.0)
    logits = torch.tensor([[4.0, -4.0, 2.0, 1.0, -1.0]]).repeat(3, 1)  # [3, 5]
    prompt, generated, draft = [0], [3, 3], [1, 3]
    penalties.apply(torch.zeros(1, 5), prompt, [])  # the first row processed: the prompt is known
    penalties.commit(generated)
    penalties.apply(logits, prompt + generated, draft)
    want = torch.tensor(
        [
            [2.0, -4.0, 2.0, 0.5 - 2.5, -1.0],  # 0: prompt (/2); 3: generated twice (/2, then -1*2 - 0.5)
            [2.0, -8.0 - 1.5, 2.0, 0.5 - 2.5, -1.0],  # + draft[0] = 1: once (*2 as negative, -1 - 0.5)
            [2.0, -8.0 - 1.5, 2.0, 0.5 - 3.5, -1.0],  # + draft[1] = 3: three times
        ]
    )
    torch.testing.assert_close(logits, want)


def test_logprobs_are_the_same_from_drafts_as_from_plain_decoding(engines, tiny_model):
    plain, _, _ = engines
    params = dataclasses.replace(BASE, logprobs=3, presence_penalty=0.5)
    wants = [plain.generate(ids, params) for ids in PROMPTS]
    speculative = oracle_engine(tiny_model, [w.token_ids for w in wants])
    for ids, want in zip(PROMPTS, wants):
        got = speculative.generate(ids, params)
        assert got.token_ids == want.token_ids and got.stats.accepted_tokens > 0
        assert [lp.token for lp in got.logprobs] == got.token_ids
        for g, w in zip(got.logprobs, want.logprobs):
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            assert g.top[0][0] == g.token and g.logprob == pytest.approx(g.top[0][1])  # greedy: the most likely
    assert plain.generate(PROMPTS[0], BASE).logprobs is None  # not kept unless asked for
    with torch.inference_mode():  # the first token's: the log-softmax of the prompt's last row (no penalty yet)
        logits = tiny_model.model(torch.tensor([PROMPTS[0]]), tiny_model.model.new_cache(64))[0, -1]
    first = plain.generate(PROMPTS[0], params).logprobs[0]
    assert first.logprob == pytest.approx(float(torch.log_softmax(logits.float(), -1)[first.token]), abs=1e-5)


@torch.inference_mode()
def exact_joint(model, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] of plain decoding with `params`' rules: for each (a, b), the rows after PROMPT,
    PROMPT + a and PROMPT + a + b, processed as a step drafting [a, b] processes them."""
    prefixes = torch.tensor([[*PROMPT, a, b] for a in range(V) for b in range(V)])  # [V*V, P+2]
    rows = model(prefixes, model.new_cache(32, V * V))[:, -3:].float()  # [V*V, 3, V]
    for (a, b), r in zip(((a, b) for a in range(V) for b in range(V)), rows):
        for processor in processors_for(params, Vocab(V)):
            processor.apply(r, PROMPT, [a, b])
    probs = logits_to_probs(rows, params).view(V, V, 3, V)
    return probs[0, 0, 0][:, None, None] * probs[:, 0, 1][:, :, None] * probs[:, :, 2]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_speculative_sampling_follows_the_penalised_distribution(drafter):
    """The first three tokens of seeded speculative runs (k=2) under penalties follow plain decoding's joint
    distribution under the same penalties (chi-square), as test_speculative's lossless test without them."""
    model, n = small_model(seed=0), 800
    base = SamplingParams(
        temperature=1.0,
        max_new_tokens=3,
        ignore_eos=True,
        presence_penalty=0.8,
        frequency_penalty=0.4,
        repetition_penalty=1.5,
    )
    decoder = Speculative(DRAFTERS[drafter](), k=2)
    counts, proposed = torch.zeros(V, V, V), 0
    for seed in range(n):
        params = dataclasses.replace(base, seed=seed)
        processing, stats = Processing(processors_for(params, Vocab(V)), PROMPT), GenerationStats()
        steps = decoder(
            model, model.new_cache(64), PROMPT, params, StopRule(params, (V - 1,), 4), stats, processing=processing
        )
        tokens = []
        for step in drive(model, steps):
            processing.commit(step)
            tokens += step
        counts[tuple(tokens[:3])] += 1
        proposed += stats.proposed_tokens
    joint = exact_joint(model, base)
    assert proposed > n
    assert chi_square_p(counts.flatten(), joint.flatten()) > 1e-3
    assert chi_square_p(counts.sum((0, 1)), joint.sum((0, 1))) > 1e-3
    free = exact_joint(model, dataclasses.replace(base, presence_penalty=0, frequency_penalty=0, repetition_penalty=1))
    assert chi_square_p(counts.flatten(), free.flatten()) < 1e-6  # the penalties do change the distribution


def test_choices_are_seeded_apart_and_bad_rules_are_refused():
    params = SamplingParams(temperature=1.0, seed=5)
    assert [params.for_choice(i).seed for i in range(3)] == [5, 6, 7]
    assert SamplingParams(seed=2**64 - 1).for_choice(2).seed == 1  # wraps around within the seeds torch takes
    assert SamplingParams().for_choice(1).seed is None
    assert SamplingParams(logit_bias={5: 1, 2: -3}).logit_bias == ((2, -3.0), (5, 1.0))
    for bad, field in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"min_tokens": 200}, "min_tokens"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="vocabulary"):
        processors_for(SamplingParams(logit_bias={V: 1.0}), Vocab(V))


class OnlyEnd:
    """Allows nothing but EOS (2), as a grammar whose answer is whole does."""

    def apply(self, logits: torch.Tensor, history, draft) -> None:
        logits[:, :2] = logits[:, 3:] = -float("inf")

    def commit(self, tokens) -> None:
        pass


def test_min_tokens_yields_where_nothing_but_the_end_is_allowed(engines, monkeypatch):
    """min_tokens comes after the grammar: where the grammar allows only the end, the output ends."""
    plain, ngram, _ = engines
    fake = [(lambda params, vocab: OnlyEnd()) if f is processors.grammar else f for f in processors.FACTORIES]
    monkeypatch.setattr(processors, "FACTORIES", fake)
    for engine in (plain, ngram):
        out = engine.generate(PROMPTS[0], dataclasses.replace(BASE, min_tokens=5))
        assert out.token_ids == [2] and out.finish_reason == "stop"


def test_a_cascade_keeps_the_rules(engines, tiny_model):
    """A cascade's top level judges its middle level's blocks on processed rows: greedy, plain decoding's output
    under the rules (the middle level drafts without them, so more of its drafts are rejected)."""
    from quasar.decoding.cascade import CascadeDrafter
    from quasar.decoding.drafters.ngram import NgramDrafter

    plain, _, free = engines
    params = dataclasses.replace(BASE, **rules([out.token_ids for out in free])["all"])
    cascade = Engine(tiny_model, Speculative(CascadeDrafter(tiny_model.model, NgramDrafter(1, 3), k=3), k=4))
    got = [cascade.generate(ids, params) for ids in PROMPTS]
    assert [g.token_ids for g in got] == [plain.generate(ids, params).token_ids for ids in PROMPTS]
    assert sum(g.stats.accepted_tokens for g in got) > 0
