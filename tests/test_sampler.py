"""The fast sampler: the filters by partial selection equal a full sort's, and tokens drawn row by row (k + 1
rows, the verify step's shape) follow the filtered distribution, for top-k / top-p / min-p combinations."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import needs_kernels

from quasar.kernels import native
from quasar.decoding.sampling import argmax_rows, Sampler, SamplingParams, draw, filtered_weights, logits_to_probs, weights_and_sums
from test_verify import chi_square_p

COMBINATIONS = {
    "T=1": SamplingParams(temperature=1.0),
    "T=0.7 top_k=20": SamplingParams(temperature=0.7, top_k=20),
    "T=1 top_p=0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "T=1.3 top_p=0.995": SamplingParams(temperature=1.3, top_p=0.995),  # the cut lies past the first candidates
    "T=0.8 min_p=0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "T=0.7 top_k=40 top_p=0.8 min_p=0.1": SamplingParams(temperature=0.7, top_k=40, top_p=0.8, min_p=0.1),
    "T=1 top_p=0.5 min_p=0.2": SamplingParams(temperature=1.0, top_p=0.5, min_p=0.2),
}

pytestmark = pytest.mark.usefixtures("sampling_path")  # every test on torch and on the kernel


def sorted_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filters the textbook way (Hugging Face's order): temperature, top-k, a full sort for top-p, min-p; in
    float64, the exact answer for float32 sums to be compared with (see near_the_cut)."""
    logits = logits.double() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs.float()


def near_the_cut(logits: torch.Tensor, params: SamplingParams, margin: float = 1e-6) -> torch.Tensor:
    """Tokens whose mass ahead of them lies within `margin` of the top-p cut: float32 sums put them on either
    side (one lay 1.2e-7 past the cut of top-p 0.995, inside it by torch's float32 cumsum on an AVX2 CPU)."""
    if params.top_p >= 1 or params.top_k > 0:
        return torch.zeros_like(logits, dtype=torch.bool)
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    near = ((sorted_probs.cumsum(-1) - sorted_probs) - params.top_p).abs() < margin
    return torch.zeros_like(near).scatter_(-1, order, near)


@pytest.mark.parametrize("name", COMBINATIONS)
def test_filters_equal_a_full_sort(name):
    params = COMBINATIONS[name]
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(0)) * 2.5  # [k + 1, V]
    fast = logits_to_probs(logits, params)
    reference = sorted_reference(logits, params)
    near = near_the_cut(logits, params)
    assert near.sum() <= 1
    assert torch.equal((fast > 0) | near, (reference > 0) | near)
    torch.testing.assert_close(fast.masked_fill(near, 0), reference.masked_fill(near, 0), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", COMBINATIONS)
def test_weights_and_their_sums_are_the_filtered_weights(name):
    """The verify step's rows (weights_and_sums: one kernel pass for the weights and sums, one for the cut) keep
    exactly the tokens filtered_weights keeps, with the same weights but for exp's last bits; -inf logits weigh 0."""
    params = COMBINATIONS[name]
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(2)) * 2.5  # [k + 1, V]
    logits[0, :10] = float("-inf")
    out = torch.empty_like(logits)
    sums = weights_and_sums(logits, params, out)
    reference = filtered_weights(logits, params)
    assert torch.equal(out > 0, reference > 0)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(sums, dtype=torch.float64), reference.double().sum(-1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", COMBINATIONS)
def test_rows_sample_the_filtered_distribution(name):
    """Each of k + 1 rows, drawn through TargetRows as the verify step does, follows logits_to_probs."""
    params, V, n = COMBINATIONS[name], 60, 3000
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1)) * 2.0  # [k + 1, V]
    expected = logits_to_probs(logits, params)
    sampler = Sampler(replace(params, seed=5))
    counts = torch.zeros(6, V)
    for _ in range(n):
        rows = sampler.rows(logits)
        for i in range(6):
            counts[i, rows.sample(i, sampler.generator)] += 1
    assert all(chi_square_p(counts[i], expected[i]) > 1e-4 for i in range(6))  # 42 comparisons in this file
    assert (counts[expected == 0] == 0).all()


def test_draw_never_picks_a_zero_weight():
    weights = torch.tensor([0.0, 1e-30, 0.0, 0.0, 3.0, 0.0])
    g = torch.Generator().manual_seed(0)
    assert {draw(weights, g) for _ in range(500)} <= {1, 4}
    assert draw(torch.zeros(4), g) is None


@needs_kernels
def test_the_greedy_token_on_the_kernel_is_torch_argmax():
    """plan.argmax_rows: torch.argmax's index on every row, including ties (the first), a NaN (the first NaN),
    rows of -inf, and vocabularies that are not a multiple of the kernel's 8 lanes."""
    native.kernel()  # loaded, so argmax_rows takes the kernel
    g = torch.Generator().manual_seed(0)
    for V in (1, 7, 8, 9, 49152, 151936):
        logits = torch.randint(-3, 4, (6, V), generator=g).float()  # many ties
        logits[1] = torch.randn(V, generator=g)
        logits[2] = float("-inf")
        logits[3, V // 2] = float("nan")
        logits[4, -1] = 100.0
        logits[5] = torch.arange(V, dtype=torch.float32).flip(0)  # the largest value first
        assert native.loaded().argmax_rows(logits).tolist() == logits.argmax(-1).tolist()
        assert argmax_rows(logits, native.kernel()).tolist() == logits.argmax(-1).tolist()


def walked_cut(logits: torch.Tensor, weights: torch.Tensor, top_k: int, top_p: float) -> tuple[float, float]:
    """One row's cut the textbook way, in float64: tokens in descending logit order, top-k's cut at the k-th, then
    top-p's at the first token where the running mass of what top-k kept reaches top_p of it -> (the cut, how far
    the running mass at the tokens around it lies from the target, relative to it: how near a rounding is)."""
    order = logits.double().sort(descending=True).values
    cut, room = float("-inf"), float("inf")
    if 0 < top_k < logits.numel():
        cut = float(order[top_k - 1])
    if top_p < 1:
        kept = logits >= cut
        values, index = logits[kept].double().sort(descending=True)
        running = weights[kept].double()[index].cumsum(0)
        target = top_p * float(running[-1])
        at = int((running < target).sum())
        cut = float(values[min(at, values.numel() - 1)])
        room = float((running - target).abs().min() / target)
    return cut, room


@needs_kernels
@pytest.mark.parametrize("V", [5, 1000, 49152])
def test_filter_cuts_walk_the_sorted_row(V):
    """The kernel's top-k / top-p cut (a selection in the row's head, or in one octave of its weights) is the logit a
    walk of the sorted row stops at, for rows with many ties, -inf logits, weights that underflow to 0 at low
    temperature and flat rows whose nucleus holds most of the vocabulary (the octave search)."""
    kernel = native.kernel()
    g = torch.Generator().manual_seed(V)
    rows = [torch.randn(V, generator=g) * 3, torch.randint(-4, 5, (V,), generator=g).float(),  # many ties
            torch.randn(V, generator=g) * 0.01, torch.randn(V, generator=g) * 30]  # flat; most weights underflow
    rows[0][: V // 5] = float("-inf")
    logits = torch.stack(rows)
    checked = 0
    for temperature in (0.05, 0.7, 1.0, 1.5):
        weights = torch.empty_like(logits)
        kernel.sampling_weights(logits, weights, 1.0 / temperature)
        for top_k, top_p in ((0, 0.9), (0, 0.5), (0, 0.999), (3, 1), (50, 1), (V, 1), (40, 0.8), (1, 0.5), (0, 1)):
            cuts = kernel.filter_cuts(logits, weights, top_k, top_p)
            assert cuts.shape == (4, 1) and cuts.dtype == torch.float32
            for r in range(4):
                expected, room = walked_cut(logits[r], weights[r], top_k, top_p)
                if room > 1e-9:  # float64 sums in another order may round to either side of a token this near
                    assert cuts[r, 0].item() == expected, (temperature, top_k, top_p, r)
                    checked += 1
    assert checked > 120  # of 144
