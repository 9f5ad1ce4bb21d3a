"""Continuous batching (quasar.decoding.batch): every request gets what it gets alone, whatever else is in the batch;
requests join and leave between steps; a cancelled or failing request leaves alone; the KV budget holds."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from conftest import needs_kernels

from helpers import default_source, decoder_for, engine_for
from quasar.decoding.batch import Batch
from quasar.decoding.engine import Engine
from quasar.decoding.step import Step, run_steps
from quasar.decoding.sampling import SamplingParams

TEXTS = ["def fib(n):", "The capital of France is", "Write a story about a cat. " * 12, "import numpy as np\n" * 4,
         "Hello", "1, 2, 3, 4, 5,", "Once upon a time", "SELECT name FROM users WHERE"]


def mixed_params() -> list[SamplingParams]:
    """Different lengths, stop rules and sampling: greedy, a stop string, EOS allowed, seeded T > 0."""
    return [
        SamplingParams(max_new_tokens=48, stop=("\n\n",)),
        SamplingParams(max_new_tokens=40),
        SamplingParams(max_new_tokens=30, stop=("cat",)),
        SamplingParams(max_new_tokens=32, temperature=0.8, seed=7),
        SamplingParams(max_new_tokens=8),
        SamplingParams(max_new_tokens=36, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=24, ignore_eos=True),
        SamplingParams(max_new_tokens=5, ignore_eos=True),
    ]


def alone_then_batched(engine: Engine, batch: Batch, texts: list[str], params: list[SamplingParams]):
    ids = [engine.encode(t, chat=False) for t in texts]
    alone = [engine.run(i, p).result() for i, p in zip(ids, params)]
    engine.caches.free.clear()  # no kept cache holds these prompts: the batch prefills them, in chunks
    requests = [engine.request(i, p) for i, p in zip(ids, params)]
    batch.run_all(requests)
    return alone, [r.output for r in requests]


def assert_same(alone, batched) -> None:
    for want, got in zip(alone, batched, strict=True):
        assert got.token_ids == want.token_ids
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason


@needs_kernels
@pytest.mark.parametrize("verifier", ["w8a8", "bf16", "w4a8"])
def test_forward_steps_give_each_sequence_its_logits_alone(verifier):
    """Several sequences' rows in one forward (prompt chunks among them) get bitwise their logits alone."""
    from quasar.verifiers.registry import load_verifier

    model = load_verifier(default_source(), verifier).model
    assert model.plan.batches_rows
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(n)] for n in (5, 40, 17)]
    with torch.inference_mode():
        alone = []
        for prompt in prompts:
            cache = model.new_cache(256)
            first = model(torch.tensor([prompt]), cache, last_only=True)[0]
            alone.append((first, model(torch.tensor([[7, 8, 9]]), cache)[0]))
        caches = [model.new_cache(256) for _ in prompts]
        one = run_steps(model, [Step(prompts[0], caches[0], True), Step(prompts[1][:10], caches[1], True),
                                   Step(prompts[2], caches[2], True)])
        two = run_steps(model, [Step([7, 8, 9], caches[0]), Step(prompts[1][10:], caches[1], True),
                                   Step([7, 8, 9], caches[2])])
        three = run_steps(model, [Step([7, 8, 9], caches[1])])
    assert [tuple(t.shape) for t in one] == [(1, model.config.vocab_size)] * 3
    assert torch.equal(one[0], alone[0][0]) and torch.equal(two[1], alone[1][0]) and torch.equal(one[2], alone[2][0])
    assert torch.equal(two[0], alone[0][1]) and torch.equal(three[0], alone[1][1]) and torch.equal(two[2], alone[2][1])


@pytest.fixture(scope="module")
def w8a8_engine():
    return engine_for("ngram+w8a8")


@needs_kernels
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=24),
                                    SamplingParams(max_new_tokens=24, temperature=0.8, seed=3)])
def test_a_next_turn_starts_from_the_kept_cache_and_answers_as_from_scratch(w8a8_engine, params):
    """Prefix caching: a chat's next turn takes the cache its last turn left, holding the conversation so far, and
    prefills only what follows; its answer is the one an empty cache gives, token for token."""
    engine = w8a8_engine
    chat = [{"role": "user", "content": "Name three rivers in Europe."}]
    first = engine.generate(engine.encode(chat), params, chat)
    chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Which one is the longest?"}]
    ids = engine.encode(chat)
    assert engine.caches.longest_prefix(ids)[1] > len(first.prompt_token_ids)
    reused = engine.generate(ids, params, chat)
    engine.caches.free.clear()
    assert engine.caches.longest_prefix(ids) == (None, 0)
    fresh = engine.generate(ids, params, chat)
    assert reused.token_ids == fresh.token_ids and reused.text == fresh.text
    assert reused.stats.cached_tokens > len(first.prompt_token_ids) and fresh.stats.cached_tokens == 0


@needs_kernels
@pytest.mark.parametrize("drafter,max_rows", [("ngram", 24), ("ngram", 3), ("none", 6), ("layerskip:10", 12)])
def test_batched_answers_equal_answers_alone(w8a8_engine, drafter, max_rows):
    """Default model, W8A8 on the kernels: 8 requests of mixed lengths, stop rules and temperatures, at most 5 at
    once (so requests join and leave mid-way), few rows per forward (drafts cut, prompts prefilled in chunks)."""
    target = w8a8_engine.target
    engine = Engine(target, decoder_for(drafter, target))
    batch = Batch(engine, max_batch=5, max_rows=max_rows)
    alone, batched = alone_then_batched(engine, batch, TEXTS, mixed_params())
    assert {a.finish_reason for a in alone} == {"stop", "length"}
    assert_same(alone, batched)
    assert batch.idle and engine.caches.taken == 0


@needs_kernels
def test_batched_answers_equal_answers_alone_on_the_files_own_blocks():
    """The w4a8 verifier (the default model's Q4_1 blocks and Q8_0 lm_head) batches as W8A8 does."""
    engine = engine_for("ngram+w4a8")
    batch = Batch(engine, max_batch=5, max_rows=6)
    alone, batched = alone_then_batched(engine, batch, TEXTS, mixed_params())
    assert_same(alone, batched)
    assert batch.idle and engine.caches.taken == 0


def test_the_torch_path_batches_too_one_forward_per_request(tiny_model):
    """fp32 runs on torch (rows not independent): each request gets its own forward, prompts whole; same answers."""
    engine = Engine(tiny_model, decoder_for("ngram", tiny_model, k=3))
    assert not tiny_model.model.plan.batches_rows
    alone, batched = alone_then_batched(engine, Batch(engine, max_batch=3, max_rows=2), TEXTS[:5], mixed_params()[:5])
    assert_same(alone, batched)


@pytest.mark.parametrize("model", ["tiny-fp32", pytest.param("ngram+w8a8", marks=needs_kernels)])
def test_cache_positions_are_never_read_before_they_are_written(model, tiny_model, monkeypatch):
    """A cache's buffers start unwritten (their memory is taken as positions are used): with them full of NaN
    instead, alone and batched answers are the same."""
    from quasar.model import kv_cache

    if model == "tiny-fp32":
        engine = Engine(tiny_model, decoder_for("ngram", tiny_model, k=3))
        batch, texts, params = Batch(engine, max_batch=3, max_rows=2), TEXTS[:5], mixed_params()[:5]
    else:
        engine, texts, params = engine_for(model), TEXTS, mixed_params()
        batch = Batch(engine, max_batch=5, max_rows=6)
    clean = alone_then_batched(engine, batch, texts, params)
    engine.caches.free.clear()
    monkeypatch.setattr(kv_cache, "blank", lambda *shape, **kw: torch.full(shape, float("nan"), **kw))
    for want, got in zip(clean, alone_then_batched(engine, batch, texts, params)):
        assert_same(want, got)


def test_cancel_frees_the_place_and_the_cache(tiny_model):
    engine = Engine(tiny_model)
    batch = Batch(engine, max_batch=1)
    first = engine.request([1, 2, 3], SamplingParams(max_new_tokens=200, ignore_eos=True))
    second = engine.request([4, 5, 6], SamplingParams(max_new_tokens=4, ignore_eos=True))
    batch.add(first)
    batch.add(second)
    batch.step()
    batch.step()
    assert batch.active == [first] and list(batch.waiting) == [second]
    batch.cancel(first)
    assert first.finished and first.cancelled and first.error is None
    assert 0 < len(first.output.token_ids) < 10 and engine.caches.taken == 0
    while not batch.idle:
        batch.step()
    assert len(second.output.token_ids) == 4 and not second.cancelled
    batch.cancel(second)  # once it ended, there is nothing to cancel
    assert not second.cancelled


def test_a_request_flagged_cancelled_leaves_at_the_next_step_and_gives_its_cache_back(tiny_model):
    """The server's scheduler flags a request from another thread; the batch drops it, running or waiting."""
    engine = Engine(tiny_model)
    batch = Batch(engine, max_batch=2)
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    running, waiting, other = (engine.request([1, 2, i], params) for i in range(3))
    for request in (running, other, waiting):
        batch.add(request)
    batch.step()
    assert batch.active == [running, other] and list(batch.waiting) == [waiting]
    running.cancelled = waiting.cancelled = True
    ended = batch.step()
    assert set(ended) == {running, waiting} and batch.active == [other] and not batch.waiting
    assert running.finished and waiting.finished and waiting.cache is None and running.error is None
    assert engine.caches.taken == other.cache_len
    while not batch.idle:
        batch.step()
    assert len(other.output.token_ids) == 50 and not other.cancelled and engine.caches.taken == 0


def test_requests_wait_until_their_cache_fits_the_kv_budget(tiny_model):
    engine = Engine(tiny_model)
    requests = [engine.request([1, 2, 3 + i], SamplingParams(max_new_tokens=6, ignore_eos=True)) for i in range(3)]
    size = requests[0].cache_len
    batch = Batch(engine, max_batch=3, kv_budget=size)  # room for one request's cache at a time
    for request in requests:
        batch.add(request)
    most = 0
    while not batch.idle:
        batch.step()
        most = max(most, len(batch.active))
        assert engine.caches.taken <= size
    assert most == 1 and all(len(r.output.token_ids) == 6 for r in requests)
    with pytest.raises(ValueError, match="KV budget"):
        Batch(engine, kv_budget=size).add(engine.request([1] * 300, SamplingParams(max_new_tokens=8)))
    for bad in ({"max_batch": 0}, {"max_rows": 0}, {"kv_budget": 0}):
        with pytest.raises(ValueError):
            Batch(engine, **bad)


def failing_on(marker: int):
    """A decoder that fails a request whose prompt holds `marker` after its prompt's forward, plain otherwise."""
    from quasar.decoding.autoregressive import autoregressive

    def decoder(model, cache, prompt_ids, params, stop, stats, processing=None):
        if marker in prompt_ids:
            yield Step(prompt_ids, cache, last_only=True)
            raise RuntimeError("this request breaks")
        yield from autoregressive(model, cache, prompt_ids, params, stop, stats)

    return decoder


def test_a_request_that_fails_inside_a_batch_fails_alone(tiny_model):
    engine = Engine(tiny_model, failing_on(99))
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    good = [engine.request([1, 2, i], params) for i in range(3)]
    bad = engine.request([1, 99, 3], params)
    overflow = engine.request([1, 2, 3], params)
    overflow.cache_len = 4  # its cache overflows in the batched forward: the step is retried one by one
    batch = Batch(engine, max_batch=8)
    for request in [*good[:2], bad, overflow, good[2]]:
        batch.add(request)
    while not batch.idle:
        batch.step()
    assert all(len(r.output.token_ids) == 5 and r.finished and r.error is None for r in good)
    assert isinstance(bad.error, RuntimeError) and bad.finished and not bad.cancelled
    assert "context window" in str(overflow.error)
    assert engine.caches.taken == 0
    with pytest.raises(RuntimeError, match="breaks"):
        batch.run_all([engine.request([99], params)])


@pytest.mark.parametrize("drafter", ["ngram", "layerskip:1"])
def test_a_seeded_request_keeps_its_sampled_drafts_uncut_and_an_unseeded_one_may_lose_them(tiny_model, drafter):
    """Cutting a model drafter's sampled draft changes which random numbers the request draws: never for a seeded
    one. An n-gram draft is matched against plain decoding's draws, which no cut changes: it may always be cut."""
    from quasar.decoding.autoregressive import StopRule
    from quasar.decoding.speculative import Speculative
    from quasar.decoding.stats import GenerationStats

    target = copy.deepcopy(tiny_model)  # a layer-skip drafter moves its target onto the kernels: not the shared one
    decoder = decoder_for(drafter, target, k=3)
    assert isinstance(decoder, Speculative)
    model, cuts = target.model, {}
    for name, params in {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=1.0, seed=1),
                         "unseeded": SamplingParams(temperature=1.0)}.items():
        params = dataclasses.replace(params, max_new_tokens=8, ignore_eos=True)
        steps = decoder(model, model.new_cache(64), [1, 2, 1, 2, 1, 2, 1], params, StopRule(params, (), 8),
                        GenerationStats())
        prefill = next(steps)
        steps.send(run_steps(model, [prefill])[0])  # -> the first token
        cuts[name] = steps.send(None).cut  # the first verify step
        steps.close()
    assert cuts == {"greedy": True, "seeded": drafter == "ngram", "unseeded": True}


@needs_kernels
def test_the_choices_of_one_prompt_prefill_it_once_and_answer_as_alone(tiny_model_dir):
    """n choices of a prompt (sampled, seeded apart): the first prefills it, the others wait for that prefill and
    start from a copy of its cache; each answers as alone from an empty cache."""
    target = tiny_on_the_kernels(tiny_model_dir)
    engine = Engine(target, decoder_for("ngram", target, k=3))
    ids = engine.encode("Once upon a time " * 8, chat=False)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, seed=4, ignore_eos=True)
    alone = []
    for i in range(3):
        engine.caches.free.clear()
        alone.append(engine.generate(ids, params.for_choice(i)))
    engine.caches.free.clear()
    choices = [engine.request(ids, params.for_choice(i)) for i in range(3)]
    Batch(engine, max_rows=16).run_all(choices)
    assert [c.output.token_ids for c in choices] == [a.token_ids for a in alone]
    assert len({tuple(a.token_ids) for a in alone}) == 3
    assert [c.output.stats.cached_tokens for c in choices] == [0, len(ids) - 1, len(ids) - 1]


def tiny_on_the_kernels(tiny_model_dir):
    """The tiny model in W8A8 on quasar's kernels (rows computed apart: a batch shares forwards and cuts drafts)."""
    from quasar.kernels import plan
    from quasar.model.loading import load
    from quasar.quant.schemes import W8A8Config, quantize_

    target = load(tiny_model_dir, "fp32")
    quantize_(target.model, W8A8Config(group_size=32))
    assert plan.prepare_(target.model).paths.startswith("kernels:")
    return target


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_a_run_is_a_batch_of_one_on_the_cache_pool_as_it_is(tiny_model, drafter):
    """Engine.run gives the tokens a Batch gives the same requests, alone or with others, and leaves the engine's
    cache pool as it found it: its settings and the caches it keeps."""
    engine = Engine(tiny_model, decoder_for(drafter, tiny_model, k=3))
    engine.caches.configure(None, 8)
    kept = [tiny_model.model.new_cache(n) for n in (1024, 1280)]  # sizes no request here takes
    engine.caches.free.extend(kept)
    ids, params = [engine.encode(t, chat=False) for t in TEXTS[:5]], mixed_params()[:5]
    alone = [engine.run(i, p).result() for i, p in zip(ids, params)]
    assert (engine.caches.budget, engine.caches.spare, engine.caches.taken) == (None, 8, 0)
    assert all(any(c is k for c in engine.caches.free) for k in kept)
    for max_batch, max_rows in ((1, 64), (3, 2)):
        batch = Batch(engine, max_batch, max_rows)
        requests = [engine.request(i, p) for i, p in zip(ids, params)]
        batch.run_all(requests)
        batch.close()
        assert_same(alone, [r.output for r in requests])
    assert (engine.caches.budget, engine.caches.spare) == (None, 8)


def test_a_run_closed_early_stops_at_once_and_one_that_fails_raises(tiny_model):
    engine = Engine(tiny_model, failing_on(99))
    run = engine.run([1, 2, 3], SamplingParams(max_new_tokens=200, ignore_eos=True))
    next(iter(run))
    run.close()
    assert 0 < len(run.output.token_ids) < 200 and engine.caches.taken == 0
    with pytest.raises(RuntimeError, match="breaks"):
        engine.run([1, 99, 3], SamplingParams(max_new_tokens=5)).result()
    assert engine.caches.taken == 0


@needs_kernels
def test_a_batch_of_one_runs_each_step_whole(tiny_model_dir):
    """A lone request prefills its prompt at once and keeps its whole draft, however few rows a shared forward would
    take and whatever the cost model says."""
    target = tiny_on_the_kernels(tiny_model_dir)
    engine = Engine(target, decoder_for("layerskip:1", target, k=3))  # a drafter that always drafts
    batch = Batch(engine, max_batch=1, max_rows=2)
    batch.cost.pays = lambda *args: False  # a cost model for which no draft row pays
    request = engine.request(engine.encode("1, 2, 1, 2, 1, 2," * 4, chat=False),
                             SamplingParams(max_new_tokens=24, ignore_eos=True))
    batch.add(request)
    batch.admit()
    drafts = 0
    while request.step is not None:
        assert batch.plan()[request] is request.step
        drafts += not request.step.last_only and len(request.step.tokens) > 1
        batch.step()
    assert drafts > 0 and len(request.output.token_ids) == 24
