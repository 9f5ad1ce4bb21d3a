"""Structured output (quasar.decoding.grammar): every row a token is picked from is masked by the grammar at its
position, so greedy constrained speculative == greedy constrained plain, batched == alone, for every kind of
constraint; forced tokens are drafted for free; at T > 0 the output follows the masked distribution; a bad
constraint is refused naming its field; an answer the budget cuts ends with "length"."""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import llguidance
import pytest
import torch
from helpers import decoder_for, drive
from test_speculative import V, exact_joint, one_thread, small_model  # noqa: F401 (one_thread: a fixture)
from test_verify import chi_square_p

from quasar.decoding.autoregressive import StopRule
from quasar.decoding.batch import Batch
from quasar.decoding.drafters.base import Draft
from quasar.decoding.drafters.model_drafter import ModelDrafter
from quasar.decoding.drafters.ngram import NgramDrafter
from quasar.decoding.engine import Engine
from quasar.decoding.grammar import Constraint, GrammarError, GrammarMask
from quasar.decoding.processors import Processing
from quasar.decoding.sampling import SamplingParams
from quasar.decoding.speculative import DraftLength, Speculative
from quasar.decoding.stats import GenerationStats

PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9, 7, 8, 9, 7], [5, 6, 5, 6, 5, 6, 5, 6]]
BOUNDED = {  # every answer is short: a random model finishes it well within the budget
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe later"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
LARK = 'start: "color: " COLOR ("," " " COLOR)* "."\nCOLOR: "red" | "green" | "blue"'
REGEX = r"(yes|no): [a-z]{1,8}( [a-z]{1,8}){0,3}\."
CONSTRAINTS = {
    "json_schema": {"json_schema": PERSON},
    "json_object": {"json_object": True},
    "regex": {"regex": REGEX},
    "grammar": {"grammar": LARK},
}


def complete(kind: str, text: str) -> bool:
    """Whether text is a whole answer of the constraint `kind` in CONSTRAINTS."""
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "grammar":
        return re.fullmatch(r"color: (red|green|blue)(, (red|green|blue))*\.", text) is not None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if kind == "json_schema":
        jsonschema.validate(value, PERSON)
    return isinstance(value, dict)


def fresh_mask(engine: Engine, params: SamplingParams) -> GrammarMask:
    from quasar.decoding.grammar import grammars_for

    return grammars_for(engine.vocab).mask(params.constraint)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "json_schema"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": [1, 2]}, "json_schema"),
        ({"regex": "(ab"}, "regex"),
        ({"grammar": "start: missing_rule"}, "grammar"),
    ],
)
def test_a_bad_constraint_is_refused_naming_its_field(fields, field):
    with pytest.raises(GrammarError) as e:
        SamplingParams(**fields)
    assert e.value.field == field and field in str(e.value)


def test_one_constraint_at_a_time_and_never_past_the_end():
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(json_object=True, regex="a+")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(regex="a+", ignore_eos=True)
    params = SamplingParams(json_schema=json.dumps(BOUNDED))
    assert params.constraint == Constraint("json_schema", BOUNDED)  # a schema's text and its dict are one schema
    assert SamplingParams().constraint is None


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_greedy_constrained_speculative_equals_plain_and_batched_equals_alone(tiny_model, kind):
    params = SamplingParams(max_new_tokens=40, **CONSTRAINTS[kind])
    plain = Engine(tiny_model)
    speculative = Engine(tiny_model, decoder_for("ngram", tiny_model, k=4))
    want = [plain.generate(ids, params) for ids in PROMPTS]
    for out in want:  # every answer is the grammar's: a whole one when it stopped, else a start of one
        assert fresh_mask(plain, params).accepted(out.token_ids) == len(out.token_ids)
        if out.finish_reason == "stop":
            assert complete(kind, out.text), out.text
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 40
    got = [speculative.generate(ids, params) for ids in PROMPTS]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    requests = [speculative.request(ids, params) for ids in PROMPTS]
    Batch(speculative).run_all(requests)
    assert [r.output.token_ids for r in requests] == [o.token_ids for o in want]
    if kind in ("json_schema", "grammar"):  # keys, quotes, separators: forced tokens, drafted and accepted, and
        assert all(o.stats.forced_tokens > 0 for o in got)  # a batch, which cuts unlikely drafts, keeps them
        assert all(r.output.stats.forced_tokens > 0 for r in requests)


def test_a_bounded_schema_is_answered_whole_and_validates(tiny_model):
    params = SamplingParams(max_new_tokens=40, json_schema=BOUNDED)
    engine = Engine(tiny_model, decoder_for("ngram", tiny_model, k=4))
    for ids in PROMPTS:
        out = engine.generate(ids, params)
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), BOUNDED)
        assert out.stats.forced_tokens > 0 and out.stats.mean_accepted_tokens > 1


def test_an_answer_the_budget_cuts_ends_with_length(tiny_model):
    out = Engine(tiny_model).generate(PROMPTS[0], SamplingParams(max_new_tokens=6, json_schema=PERSON))
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_forced_drafting_emits_more_per_step_with_the_same_output(tiny_model):
    params = SamplingParams(max_new_tokens=40, json_schema=BOUNDED)
    forced = Engine(tiny_model, decoder_for("ngram", tiny_model, k=4))
    unforced = Engine(tiny_model, decoder_for("ngram", tiny_model, k=4))
    unforced.decoder.forced_drafts = False
    a, b = forced.generate(PROMPTS[0], params), unforced.generate(PROMPTS[0], params)
    assert a.token_ids == b.token_ids
    assert b.stats.forced_tokens == 0 < a.stats.forced_tokens
    assert a.stats.verify_steps < b.stats.verify_steps


# ---- T > 0 on a toy vocabulary: the output follows the verifier's distribution with the grammar's mask ---------


class ToyTokenizer:
    """V = 8 tokens for llguidance: a, b, c, ab, {, }, x and the end of text (7, as test_speculative's EOS)."""

    def __init__(self) -> None:
        self.tokens = [b"a", b"b", b"c", b"ab", b"{", b"}", b"x", b"<end>"]
        self.eos_token_id, self.bos_token_id, self.special_token_ids = V - 1, None, [V - 1]

    def __call__(self, text: bytes | str) -> list[int]:
        """Greedy: "ab" as one token; bytes outside the vocabulary are dropped."""
        text = text.encode() if isinstance(text, str) else text
        out, i = [], 0
        while i < len(text):
            size = 2 if text[i : i + 2] == b"ab" else 1
            if text[i : i + size] in self.tokens:
                out.append(self.tokens.index(text[i : i + size]))
            i += size
        return out


TOY_GRAMMAR = r"[abc]x[abc]{1,4}"  # after the first token, "x" is forced: drafted for free


@functools.cache
def toy_grammar() -> tuple[llguidance.LLTokenizer, str]:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ToyTokenizer())), Constraint("regex", TOY_GRAMMAR).grammar


def toy_mask() -> GrammarMask:
    matcher = llguidance.LLMatcher(*toy_grammar(), log_level=0)
    return GrammarMask(matcher, V, eos_ids=(V - 1,))


def allowed(prefix: list[int]) -> torch.Tensor:
    """The tokens [V] (bool) the toy grammar allows after `prefix` (none when it rejects the prefix)."""
    mask = toy_mask()
    if mask.accepted(prefix) < len(prefix):
        return torch.zeros(V, dtype=torch.bool)
    mask.commit(prefix)
    row = torch.zeros(1, V)
    mask.apply(row, prefix, [])
    return row[0] == 0


def masked_joint(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] under the model with the grammar's mask at every position: the model's own
    conditionals (exact_joint's factors, all positive at T = 1) masked and renormalised."""
    free = exact_joint(model, prompt, params)  # P(a) P(b | a) P(c | a, b)

    def masked(probs: torch.Tensor, prefix: list[int]) -> torch.Tensor:
        kept = probs * allowed(prefix)
        return kept / kept.sum() if kept.sum() > 0 else kept

    first = masked(free.sum((1, 2)), [])
    joint = torch.zeros(V, V, V)
    for a in range(V):
        second = masked(free[a].sum(1) / free[a].sum(), [a])
        for b in range(V):
            joint[a, b] = first[a] * second[b] * masked(free[a, b] / free[a, b].sum(), [a, b])
    return joint


def run_constrained(
    model, decoder, prompt: list[int], params: SamplingParams, mask: GrammarMask
) -> tuple[list[int], GenerationStats]:
    """run() with the grammar as the request's processor, committed each step as Request.emit does."""
    processing = Processing([mask], prompt)
    cache, stats = model.new_cache(64), GenerationStats()
    steps = decoder(model, cache, prompt, params, StopRule(params, (V - 1,), 4), stats, processing=processing)
    out: list[int] = []
    for tokens in drive(model, steps):
        processing.commit(tokens)
        out += tokens
    return out, stats


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.usefixtures("one_thread")
def test_sampling_follows_the_masked_distribution(drafter):
    """The first three emitted tokens of constrained speculative decoding (forced tokens drafted, the drafter's
    tokens after them) follow the verifier's joint distribution under the grammar's mask."""
    model, n = small_model(seed=0), 800
    drafters = {"ngram": lambda: NgramDrafter(1, 3), "model": lambda: ModelDrafter(small_model(1, 3.0), V)}
    decoder = Speculative(drafters[drafter](), k=2)
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    counts, forced = torch.zeros(V, V, V), 0
    for seed in range(n):
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=3)
        tokens, stats = run_constrained(model, decoder, prompt, params, toy_mask())
        assert toy_mask().accepted(tokens) == len(tokens)
        counts[tuple(tokens[:3])] += 1
        forced += stats.forced_tokens
    joint = masked_joint(model, prompt, SamplingParams(temperature=1.0))
    assert forced > n / 4  # the grammar's forced tokens were drafted, and accepted
    assert chi_square_p(counts.flatten(), joint.flatten()) > 1e-3


def test_the_default_model_extracts_an_object_that_validates(default_model):
    """Real weights: a schema'd extraction from a passage is answered whole, validates, and speculative decoding
    with grammar drafting gives plain decoding's tokens in fewer steps."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    plain = Engine(default_model)
    speculative = Engine(default_model, decoder_for("ngram", default_model))
    ask = "Give the person as JSON with name, age and city.\n\nMaria Lopez is 34 years old and lives in Madrid."
    ids = plain.encode(ask)
    params = SamplingParams(max_new_tokens=64, json_schema=schema)
    want, got = plain.generate(ids, params), speculative.generate(ids, params)
    assert want.finish_reason == "stop"
    answer = json.loads(want.text)
    jsonschema.validate(answer, schema)
    assert answer["name"] == "Maria Lopez" and answer["age"] == 34
    assert got.token_ids == want.token_ids
    assert got.stats.forced_tokens > 0 and got.stats.verify_steps < want.stats.verify_steps


class PastTheEnd:
    """A deterministic drafter that always proposes "c", the end of text, then more text."""

    free = False

    def spawn(self):
        return self

    def reset(self) -> None:
        pass

    def commit(self, tokens: list[int]) -> None:
        pass

    def rewind(self, n: int) -> None:
        pass

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        return Draft([2, V - 1, 0, 0][:k])


@pytest.mark.parametrize("forced_drafts", [True, False])
@pytest.mark.usefixtures("one_thread")
def test_a_draft_past_the_end_of_the_answer_is_judged_and_cut_at_the_end(forced_drafts):
    """Rows after a draft's end of text are never emitted, so the grammar leaves them alone (masked, they would
    allow nothing, and a sampled bonus token from them would have no token to draw)."""
    model = small_model(seed=0)
    decoder = Speculative(PastTheEnd(), k=4, forced_drafts=forced_drafts)
    prompt = [1, 2, 3, 4, 1, 2]
    ends = 0
    for seed in range(60):
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=8)
        tokens, _ = run_constrained(model, decoder, prompt, params, toy_mask())
        assert toy_mask().accepted(tokens) == len(tokens)
        ends += tokens[-1] == V - 1
    assert ends > 0  # some answers ended on the drafted end of text


def test_a_batch_plan_takes_forced_tokens_as_certain():
    """A busy batch keeps the draft rows likeliest to be accepted: a forced token's row counts as certain, whatever
    the drafter's recent acceptance (else a batch would cut the free tokens first)."""
    length = DraftLength(4)
    for _ in range(20):
        length.update(proposed=4, accepted=0)  # the drafter's tokens are rejected at once
    unforced, forced = length.chances(3), length.chances(3, forced=(0, 1))
    assert unforced[0] < 0.1 and forced[:2] == (1.0, 1.0)
    assert forced[2] == pytest.approx(length.hits[2] / length.tries[2])


def test_each_turn_of_a_chat_is_held_to_the_schema(tiny_model):
    """`quasar chat --json-schema`: every answer of the conversation validates."""
    from quasar.decoding.conversation import Conversation

    conversation = Conversation(Engine(tiny_model, decoder_for("ngram", tiny_model, k=4)))
    params = SamplingParams(max_new_tokens=40, json_schema=BOUNDED)
    for text in ("Is it raining?", "And tomorrow?"):
        turn = conversation.send(text, params)
        "".join(turn)
        assert turn.output.finish_reason == "stop"
        jsonschema.validate(json.loads(turn.output.text), BOUNDED)
    assert len(conversation.messages) == 4  # both answers are in the conversation the next turn reads


def test_min_tokens_past_a_whole_answer_yields_to_the_grammar(tiny_model):
    """min_tokens beyond a bounded answer's length: where the grammar allows only the end, the answer ends."""
    params = SamplingParams(max_new_tokens=40, json_schema=BOUNDED, min_tokens=30)
    for engine in (Engine(tiny_model), Engine(tiny_model, decoder_for("ngram", tiny_model, k=4))):
        out = engine.generate(PROMPTS[0], params)
        assert out.finish_reason == "stop" and len(out.token_ids) < 30
        jsonschema.validate(json.loads(out.text), BOUNDED)
