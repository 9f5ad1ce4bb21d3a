"""verify_candidates: several candidates for one position, distinct deterministic ones (the target sampled without
replacement) or i.i.d. draws from a draft distribution (SpecInfer's multi-step rule). The token follows the target
row exactly; one candidate is rejection_sample's rule draw for draw; greedy is the argmax; bad candidates are refused."""

from __future__ import annotations

import pytest
import torch

from quasar.decoding.multi_candidate import Candidates, Choice, greedy_choice, verify_candidates
from quasar.decoding.rejection import DenseDraft, rejection_sample
from quasar.decoding.sampling import Sampler, SamplingParams, TargetRows, logits_to_probs
from test_verify import chi_square_p, one_hot, rows

pytestmark = pytest.mark.usefixtures("sampling_path")  # every test on torch and on the kernel

V, ZERO = 8, 2  # the toy vocabulary; ZERO's logit is -inf, so the target never emits it
TARGETS = {"T=1": SamplingParams(temperature=1.0), "T=0.7 top_k=5": SamplingParams(temperature=0.7, top_k=5)}
DRAWS = 3000  # per candidate set


def target(params: SamplingParams) -> tuple[TargetRows, torch.Tensor, list[int]]:
    """One target row as the verify step reads it, its probabilities [V] and the tokens from the most likely down."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0)) * 1.5  # [1, V]
    logits[0, ZERO] = float("-inf")
    probs = logits_to_probs(logits, params)[0]  # [V]
    return Sampler(params).rows(logits), probs, probs.argsort(descending=True).tolist()


def assert_follows(counts: torch.Tensor, probs: torch.Tensor) -> None:
    assert (counts[probs == 0] == 0).all()
    assert chi_square_p(counts, probs) > 1e-3


@pytest.mark.parametrize("name", TARGETS)
def test_deterministic_candidates_follow_the_target(name):
    """Distinct candidates tried in order, each accepted with its probability under the target less the ones
    rejected before it: the top token first or later, tokens of target probability 0, one to three candidates."""
    rows_, probs, ranked = target(TARGETS[name])
    top, second, third = ranked[:3]
    g = torch.Generator().manual_seed(1)
    for tokens in ([second], [ZERO, top], [top, ZERO, third]):
        candidates = Candidates(tokens)
        counts, accepted = torch.zeros(V), torch.zeros(len(tokens) + 1)
        for _ in range(DRAWS):
            choice = verify_candidates(candidates, rows_, 0, g)
            counts[choice.token] += 1
            accepted[len(tokens) if choice.accepted is None else choice.accepted] += 1
            assert choice.accepted is None or tokens[choice.accepted] == choice.token
        assert_follows(counts, probs)
        assert accepted[:-1].tolist() == counts[tokens].tolist()  # the residual never holds a candidate


DRAFTS = {  # [1, V] draft rows: mass on the target's top token (0) and on tokens it never emits (ZERO; 5 at T=0.7)
    "dense": DenseDraft(torch.softmax(torch.randn(1, V, generator=torch.Generator().manual_seed(2)), -1)),
    "sparse": DenseDraft(torch.zeros(1, V).index_put_((torch.tensor([0, 0, 0, 0]), torch.tensor([ZERO, 0, 5, 6])),
                                                      torch.tensor([0.2, 0.4, 0.3, 0.1]))),  # mass on four tokens
}


@pytest.mark.parametrize("name", TARGETS)
def test_sampled_candidates_follow_the_target(name):
    """Candidates drawn i.i.d. from a draft distribution (repeats and all), accepted with min(1, r / draft) against
    the residual r left by the ones rejected before them: one to three candidates, dense and sparse drafts."""
    rows_, probs, ranked = target(TARGETS[name])
    assert ranked[0] == 0  # as DRAFTS has it
    g = torch.Generator().manual_seed(3)
    for draft, c in ((DRAFTS["dense"], 1), (DRAFTS["dense"], 2), (DRAFTS["sparse"], 3)):
        support = torch.tensor([[draft.prob(0, t) for t in range(V)]]).expand(DRAWS, V)  # [DRAWS, V]
        counts = torch.zeros(V)
        for tokens in torch.multinomial(support, c, replacement=True, generator=g).tolist():  # [DRAWS, c] i.i.d.
            counts[verify_candidates(Candidates(tokens, draft), rows_, 0, g).token] += 1
        assert_follows(counts, probs)


@pytest.mark.parametrize("sampled", [False, True])
def test_one_candidate_is_the_single_candidate_rule_draw_for_draw(sampled):
    """c = 1 with the generator in the same state: rejection_sample of a one-token draft accepts the same
    candidate and recovers the same token (it draws its one uniform number, then the residual, in the same order)."""
    params = SamplingParams(temperature=0.7, top_k=6)
    rows_ = Sampler(params).rows(torch.randn(2, V, generator=torch.Generator().manual_seed(4)))  # row 1: the bonus
    draft = DRAFTS["dense"] if sampled else None
    draft_g = torch.Generator().manual_seed(5)
    outcomes = set()
    for seed in range(1500):
        token = int(torch.multinomial(DRAFTS["dense"].probs[0], 1, generator=draft_g)) if sampled else seed % V
        verdict = rejection_sample([token], draft, rows_, torch.Generator().manual_seed(seed))
        choice = verify_candidates(Candidates([token], draft), rows_, 0, torch.Generator().manual_seed(seed))
        assert (choice.accepted == 0) == (verdict.accepted == 1)
        assert choice.token == (token if verdict.accepted else verdict.token)
        outcomes.add(verdict.accepted)
    assert outcomes == {0, 1}


def test_greedy_is_the_argmax():
    """greedy_choice is plain greedy decoding's token, accepting the first candidate equal to it, and is what
    verify_candidates gives on a one-hot target row, for deterministic and sampled candidates."""
    g = torch.Generator().manual_seed(6)
    greedy = Sampler(SamplingParams(temperature=0.0))
    draft = DRAFTS["dense"]
    hits = 0
    for _ in range(300):
        logits = torch.randn(V, generator=g)  # [V]
        best = greedy.next_token(logits)
        distinct = torch.randperm(V, generator=g)[: int(torch.randint(1, 4, (), generator=g))].tolist()
        drawn = torch.multinomial(draft.probs[0], 3, replacement=True, generator=g).tolist()
        for tokens, probs in ((distinct, None), (drawn, draft)):
            choice = greedy_choice(tokens, best)
            assert choice.token == best == int(logits.argmax())
            assert choice.accepted == (tokens.index(best) if best in tokens else None)
            assert verify_candidates(Candidates(tokens, probs), rows(one_hot([best], V)), 0, g) == choice
            hits += choice.accepted is not None
    assert 0 < hits < 600


def test_seeded_choices_repeat_whatever_the_global_generator():
    rows_, _, ranked = target(TARGETS["T=1"])
    candidates = Candidates(ranked[1:4])
    runs = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        g = torch.Generator().manual_seed(7)
        runs.append([verify_candidates(candidates, rows_, 0, g) for _ in range(200)])
    assert runs[0] == runs[1]
    assert len({choice.accepted for choice in runs[0]}) == 4  # each candidate accepted, and all rejected


def test_no_candidates_draw_the_bonus_token_from_the_row():
    rows_, _, _ = target(TARGETS["T=1"])
    for seed in range(50):
        choice = verify_candidates(Candidates([]), rows_, 0, torch.Generator().manual_seed(seed))
        assert choice == Choice(None, rows_.sample(0, torch.Generator().manual_seed(seed)))


def test_bad_candidates_are_refused():
    with pytest.raises(ValueError, match="must be distinct"):
        Candidates([3, 1, 3])
    with pytest.raises(ValueError, match="candidate 4 has draft probability 0"):
        Candidates([5, 4], DRAFTS["sparse"])
    Candidates([5, 5, 6], DRAFTS["sparse"])  # i.i.d. draws repeat
