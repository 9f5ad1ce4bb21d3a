"""rejection_sample: greedy special case, bonus/recovered tokens, and the target distribution exactly."""

from __future__ import annotations

import pytest
import torch

from quasar.decoding.sampling import Sampler, SamplingParams, TargetRows
from quasar.decoding.rejection import DenseDraft, greedy_verdict, matched_verdict, rejection_sample

pytestmark = pytest.mark.usefixtures("sampling_path")  # every test on torch and on the kernel


def rows(target_probs: torch.Tensor) -> TargetRows:
    """Target rows [k + 1, V] with exactly these probabilities (logits log p at temperature 1)."""
    return Sampler(SamplingParams(temperature=1.0)).rows(target_probs.log())


def one_hot(ids: list[int], V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()  # [n, V]


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of observed counts [C] against probabilities [C] (cells with
    expected count < 5 are pooled)."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_greedy_accepts_iff_draft_is_argmax():
    V, g = 10, torch.Generator().manual_seed(0)
    target = one_hot([3, 5, 7, 1], V)  # greedy target distributions [k+1, V]
    assert (v := rejection_sample([3, 5, 7], None, rows(target), g)).accepted == 3 and v.token == 1
    assert (v := rejection_sample([3, 4, 7], None, rows(target), g)).accepted == 1 and v.token == 5
    assert (v := rejection_sample([0, 5, 7], None, rows(target), g)).accepted == 0 and v.token == 3
    draft_probs = one_hot([3, 4, 7], V)  # a greedy model drafter: one-hot draft distributions
    assert (v := rejection_sample([3, 4, 7], DenseDraft(draft_probs), rows(target), g)).accepted == 1 and v.token == 5


def test_greedy_verdict_equals_rejection_sampling_of_the_argmax():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(0, 6, ()))
        logits = torch.randn(k + 1, 8)  # [k+1, V]
        best = logits.argmax(-1)
        draft = torch.where(torch.rand(k) < 0.7, best[:k], torch.randint(0, 8, (k,)))  # mostly right
        expected = rejection_sample(draft.tolist(), None, rows(one_hot(best.tolist(), 8)), g)
        assert greedy_verdict(draft.tolist(), best.tolist()) == expected


def test_empty_draft_samples_from_the_first_target_row():
    target = one_hot([4], 6)
    v = rejection_sample([], None, rows(target), torch.Generator().manual_seed(0))
    assert (v.accepted, v.token) == (0, 4)


def test_zero_target_probability_is_never_accepted():
    target = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        v = rejection_sample([0], None, rows(target), g)
        assert v.accepted == 0 and v.token in (1, 2)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_emitted_tokens_follow_the_target_distribution(with_draft_probs):
    """First and second emitted token, sampled many times, match target_probs[0] and the exact
    marginal of the second position (a wrong acceptance or residual rule fails this)."""
    V, n = 6, 6000
    g = torch.Generator().manual_seed(123)
    target = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)  # [k+1, V], k = 2
    draft_probs = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)  # [k, V]
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        if with_draft_probs:
            draft = torch.multinomial(draft_probs, 1, generator=g)[:, 0]  # [k]
        else:
            draft = torch.tensor([0, 1])  # a deterministic drafter: always the same guess
        v = rejection_sample(draft.tolist(), DenseDraft(draft_probs) if with_draft_probs else None, rows(target), g)
        emitted = [*draft[: v.accepted].tolist(), v.token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    assert chi_square_p(first, target[0]) > 1e-3
    # Position 2 is emitted only when token 1 was the draft's: then it follows target[1] (row 1's context).
    assert chi_square_p(second, target[1]) > 1e-3


def test_a_matched_draft_emits_the_draws_of_plain_decoding():
    """matched_verdict: each emitted token is the draw plain decoding makes from the same generator, whatever the
    draft (right, wrong, long, empty), one uniform number per emitted token; a draft token is kept iff it is the
    draw."""
    V = 6
    g = torch.Generator().manual_seed(5)
    target = torch.softmax(torch.randn(4, V, generator=g) * 1.5, -1)  # [k + 1, V], k = 3
    for seed in range(200):
        drawn = [rows(target).sample(i, torch.Generator().manual_seed(seed)) for i in range(4)]
        plain = torch.Generator().manual_seed(seed)
        plain_tokens = [rows(target[i : i + 1]).sample(0, plain) for i in range(4)]  # one plain step a row
        for draft in ([], plain_tokens[:3], [plain_tokens[0], (plain_tokens[1] + 1) % V, 0], [(drawn[0] + 1) % V]):
            v = matched_verdict(draft, rows(target), torch.Generator().manual_seed(seed))
            emitted = [*draft[: v.accepted], v.token]
            assert emitted == plain_tokens[: len(emitted)]
            assert v.accepted == len(draft) or draft[v.accepted] != v.token


def test_a_matched_draft_follows_the_target_as_rejection_sampling_does():
    """The law of a deterministic draft's verdict: token d_i kept with probability target_probs[i, d_i] (as
    rejection_sample with a one-hot draft), the next token from the target without it."""
    V, n = 6, 6000
    g = torch.Generator().manual_seed(11)
    target = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)  # [k + 1, V], k = 2
    first, second, kept = torch.zeros(V), torch.zeros(V), 0
    for _ in range(n):
        v = matched_verdict([0, 1], rows(target), g)
        emitted = [*[0, 1][: v.accepted], v.token]
        kept += v.accepted > 0
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    assert chi_square_p(first, target[0]) > 1e-3
    assert chi_square_p(second, target[1]) > 1e-3
    assert abs(kept / n - float(target[0, 0])) < 4 * (float(target[0, 0]) / n) ** 0.5 + 0.01
