"""The Python API: `from quasar import LLM, SamplingParams`."""

from __future__ import annotations

import pytest

from quasar import LLM, SamplingParams
from quasar.decoding.engine import Engine

GREEDY = SamplingParams(max_new_tokens=10)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(tiny_model_dir)


def test_generate_returns_text_token_ids_and_stats_in_order(llm, tiny_model):
    prompts = ["The first prompt", "A second, different prompt"]
    outputs = llm.generate(prompts, GREEDY)
    assert [o.prompt for o in outputs] == prompts
    engine = Engine(tiny_model)
    for prompt, out in zip(prompts, outputs):
        reference = engine.generate(engine.encode(prompt, chat=False), GREEDY)
        assert out.token_ids == reference.token_ids and out.text == reference.text
        assert out.stats.new_tokens == len(out.token_ids) <= 10
        assert out.stats.mean_accepted_tokens == 1.0
    assert outputs[0].token_ids != outputs[1].token_ids


def test_stream_pieces_join_to_the_generated_text(llm):
    pieces = list(llm.stream("Streaming test", GREEDY))
    assert len(pieces) > 1
    assert "".join(pieces) == llm.generate("Streaming test", GREEDY)[0].text


def test_stopping_a_stream_early_stops_generation(llm):
    stream = llm.stream("Stop me", SamplingParams(max_new_tokens=400, ignore_eos=True))
    next(stream)
    stream.close()
    cache = llm.engine.caches.free[-1]  # the stream's cache, given back when it closed
    assert cache.length < 50  # generation stopped after a step or two, not 400 tokens


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, GREEDY)
    assert out.text == llm.generate(["Hello there"], GREEDY, chat=True)[0].text
    both = llm.chat([messages, [{"role": "user", "content": "Another one"}]], GREEDY)
    assert next(o.text for o in both) == out.text and len(both) == 2


def test_sampling_with_a_seed_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=8)
    assert llm.generate("seeded", params)[0].token_ids == llm.generate("seeded", params)[0].token_ids


def test_unknown_drafter_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="drafter"):
        LLM(tiny_model_dir, drafter="no-such-drafter")


@pytest.mark.slow
def test_ngram_drafter_on_the_default_model_is_lossless_and_accepts_drafts():
    prompt = "Repeat exactly: one two three four five six seven eight. Repeat exactly: one two three four"
    params = SamplingParams(max_new_tokens=24)
    plain = LLM("default").generate(prompt, params)[0]
    spec = LLM("default", drafter="ngram", k=4).generate(prompt, params)[0]
    assert spec.token_ids == plain.token_ids  # greedy speculative == greedy plain
    assert spec.stats.proposed_tokens > 0 and spec.stats.mean_accepted_tokens > 1.0


def test_a_context_window_of_zero_is_refused(tiny_model):
    from quasar.decoding.engine import Engine

    with pytest.raises(ValueError, match="max_context must be a positive"):
        Engine(tiny_model, max_context=0)
