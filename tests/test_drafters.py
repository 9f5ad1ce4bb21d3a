"""Drafters: prompt lookup semantics, suffix memory across requests, model drafters, the registry."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from quasar.decoding.drafters import DrafterOptions, build_drafter
from quasar.decoding.drafters.model_drafter import ModelDrafter
from quasar.decoding.drafters.ngram import NgramDrafter
from quasar.decoding.drafters.suffix import SuffixDrafter
from quasar.verifiers.pruned import dropped_layers, keep_layers
from quasar.decoding.sampling import SamplingParams

GREEDY, GEN = SamplingParams(), torch.Generator()


def propose(drafter, k=4) -> list[int]:
    return drafter.propose(k, GREEDY, GEN).tokens


def test_ngram_prefers_the_longest_match_then_the_earliest_occurrence():
    d = NgramDrafter(1, 3)
    d.commit([7, 1, 2, 3, 9, 9, 5, 2, 3, 8, 8, 1, 2, 3])
    assert propose(d) == [9, 9, 5, 2]  # 3-gram (1, 2, 3) first seen at 1..3
    d.reset()
    d.commit([5, 2, 3, 8, 6, 2, 3, 7, 7, 4, 3])
    assert propose(d, k=2) == [8, 6]  # only the 1-gram (3) matches; its earliest occurrence
    d.commit([1])
    assert propose(d, k=3) == []  # (1) never seen before with a continuation: no draft
    assert propose(d, k=0) == []


@pytest.mark.parametrize("make", [lambda: NgramDrafter(1, 3), lambda: SuffixDrafter(1, 8)])
def test_a_free_drafters_drafts_are_deterministic(make):
    """What `free` promises the engine (it matches their sampled drafts against plain decoding's draws): a draft
    without a distribution, the same at every temperature, and no random number taken from the request's generator,
    for chains and trees alike."""
    d = make()
    d.commit([9, 1, 2, 8, 1, 2, 8, 1, 2, 7, 5, 1, 2])
    assert d.free
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    drafts = [d.propose(3, SamplingParams(temperature=t), g) for t in (0.0, 0.7, 1.0)]
    assert all(draft.probs is None and draft.tokens == drafts[0].tokens for draft in drafts) and drafts[0].tokens
    tree = d.propose_tree(6, 2, lambda depth, rank: 0.5)
    assert len(tree) > 0 and d.propose_tree(6, 2, lambda depth, rank: 0.5) == tree
    assert torch.equal(g.get_state(), state)


def test_sampled_ngram_drafts_are_the_greedy_copy_and_draw_nothing():
    """At T > 0 the draft is the copy greedy decoding gets (verified by matching plain decoding's draws), with no
    draft distribution and no random number taken from the request's generator."""
    d = NgramDrafter(1, 3)
    d.commit([9, 1, 2, 8, 1, 2, 8, 1, 2, 7, 5, 1, 2])  # (1, 2) was followed by 8, 8 and 7
    sampled, g = SamplingParams(temperature=1.0), torch.Generator().manual_seed(0)
    state = g.get_state()
    draft = d.propose(3, sampled, g)
    assert draft.tokens == propose(d, k=3) == [8, 1, 2] and draft.probs is None
    assert torch.equal(g.get_state(), state)
    d.commit([6])
    assert d.propose(3, sampled, g).tokens == []  # (6) never seen with a continuation


@pytest.mark.parametrize("make", [lambda: NgramDrafter(1, 3), lambda: SuffixDrafter(1, 8)])
def test_rewind_forgets_exactly_the_last_tokens(make):
    """A cascade's middle level commits tokens the top level may reject: after rewind(n) the drafter proposes
    (greedy and sampled) as if those n tokens had never been committed."""
    stream, extra = [4, 1, 2, 3, 9, 1, 2, 5, 4, 1], [2, 3, 7, 1, 2, 6]
    fresh, rewound = make(), make()
    fresh.commit(stream)
    rewound.commit(stream)
    rewound.commit(extra[:2])
    rewound.commit(extra[2:])
    rewound.rewind(len(extra))
    assert rewound.index.followers == fresh.index.followers
    assert rewound.index.where == fresh.index.where  # keep='last' too: the occurrences the extra ones covered are back
    assert rewound.index.earlier == fresh.index.earlier
    sampled = SamplingParams(temperature=1.0)
    assert propose(rewound) == propose(fresh)
    assert rewound.propose(3, sampled, torch.Generator().manual_seed(1)) == fresh.propose(3, sampled, torch.Generator().manual_seed(1))


def test_ngram_respects_ngram_min_and_k():
    d = NgramDrafter(2, 3)
    d.commit([4, 5, 6, 1, 2, 6])  # only the 1-gram (6) repeats
    assert propose(d) == []
    d.commit([1, 2])
    assert propose(d, k=1) == [6]


def test_ngram_index_is_incremental():
    """Committing token by token gives the same drafts as committing at once."""
    tokens = torch.randint(0, 5, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    whole, steps = NgramDrafter(1, 3), NgramDrafter(1, 3)
    for i, t in enumerate(tokens):
        steps.commit([t])
        whole.reset()
        whole.commit(tokens[: i + 1])
        assert propose(steps) == propose(whole)


def test_suffix_drafter_remembers_earlier_requests():
    d = SuffixDrafter(1, 8)
    d.commit([1, 2, 3, 4, 10, 11, 12, 13, 14, 15])
    d.reset()
    d.commit([7, 7, 10, 11])
    assert propose(d, k=3) == [12, 13, 14]
    fresh = NgramDrafter(1, 3)
    fresh.commit([7, 7, 10, 11])
    assert propose(fresh) == []  # prompt lookup alone has nothing to go on


def test_suffix_drafters_of_one_decoder_share_what_finished_requests_said():
    """Concurrent requests' drafters (spawned from one) draft from every finished request, never from a request still
    in flight."""
    first = SuffixDrafter(1, 8)
    second = first.spawn()
    first.commit([1, 2, 3, 4, 10, 11, 12, 13, 14, 15])
    second.commit([9, 10, 11])
    assert propose(second, k=3) == []  # the first request is still running
    first.reset()  # it ended: its tokens are in the store
    assert propose(second, k=3) == [12, 13, 14]
    second.reset()
    third = first.spawn()
    third.commit([5, 9, 10])
    assert propose(third, k=2) == [11]  # the most recent occurrence: the second request's, which ends there
    tree = third.propose_tree(4, 2, lambda depth, rank: 0.5)
    assert [tree.tokens[c] for c in tree.children(-1)] == [11]  # both requests continued 10 with 11


def test_suffix_drafter_history_is_bounded():
    d = SuffixDrafter(1, 4, max_history=100)
    for r in range(20):
        d.reset()
        d.commit([r] * 5 + list(range(30, 40)))
    assert sum(len(doc) for doc in d.store.docs) <= 100
    d.reset()
    d.commit([33, 34])
    assert propose(d, k=2) == [35, 36]


def test_model_drafter_cache_follows_the_committed_stream(tiny_model):
    """After partial acceptance the drafter's own cache is rolled back; drafts equal a fresh drafter's."""
    model = tiny_model.model
    drafter, prompt = ModelDrafter(model, model.config.vocab_size), [1, 50, 60, 70]
    drafter.commit(prompt)
    first = drafter.propose(4, GREEDY, GEN)
    assert len(first) == 4 and first.probs.probs.shape == (4, model.config.vocab_size)
    drafter.commit(first.tokens[:2] + [123])  # two accepted, then a recovered token
    second = drafter.propose(3, GREEDY, GEN).tokens
    fresh = ModelDrafter(model, model.config.vocab_size)
    fresh.commit(prompt + first.tokens[:2] + [123])
    assert second == fresh.propose(3, GREEDY, GEN).tokens
    assert drafter.cache.length == len(prompt) + 2 + 1 + 2  # committed tokens + 2 drafted-and-fed


def test_model_drafter_refuses_another_tokenizer(tiny_model, tiny_model_dir, tmp_path):
    other = shutil.copytree(tiny_model_dir, tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, different meaning
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer"):
        build_drafter(f"model:{other}", tiny_model)
    assert isinstance(build_drafter(f"model:{tiny_model_dir}", tiny_model), ModelDrafter)


def test_layerskip_shares_weights_and_has_its_own_cache(default_model):
    drafter = build_drafter("layerskip:4", default_model)
    shallow = drafter.model
    assert len(shallow.model.layers) == 4 and shallow.new_cache(8).k.shape[0] == 4
    assert shallow.model.layers[3] is default_model.model.model.layers[3]
    assert shallow.lm_head.weight.data_ptr() == default_model.model.lm_head.weight.data_ptr()
    drafter.commit([1, 2, 3])
    assert len(drafter.propose(3, GREEDY, GEN)) == 3
    assert default_model.model.model.layers[3].self_attn.layer == 3  # the verifier's numbering is untouched


def test_registry_parses_names_and_rejects_bad_ones(tiny_model):
    assert build_drafter("none", tiny_model) is None
    assert isinstance(build_drafter("ngram", tiny_model, DrafterOptions(2, 4)), NgramDrafter)
    assert isinstance(build_drafter("suffix", tiny_model), SuffixDrafter)
    for bad in ("eagle", "model", "layerskip", "layerskip:0", "layerskip:2", "ngram:3"):
        with pytest.raises(ValueError):
            build_drafter(bad, tiny_model)
    with pytest.raises(ValueError):
        DrafterOptions(ngram_min=3, ngram_max=2)


def test_pruned_drops_the_layers_before_the_last(tiny_model):
    assert dropped_layers(30, 4) == [25, 26, 27, 28]
    with pytest.raises(ValueError):
        dropped_layers(4, 3)
    from quasar.model.loading import load

    own = load(tiny_model.directory, "fp32").model
    small = keep_layers(own, [1])
    assert len(small.model.layers) == 1 and small.model.layers[0].self_attn.layer == 0
    logits = small(torch.tensor([[1, 2, 3]]), small.new_cache(8))
    assert logits.shape == (1, 3, own.config.vocab_size)
