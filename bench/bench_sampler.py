"""The verify step's sampler at T > 0, old against new, on the default model's vocabulary size (49,152).

`sorted` is the plain baseline: temperature, top-k, softmax, a full sort for top-p, then
torch.multinomial over the vocabulary, for every row of the step. `quasar` is quasar.decoding.sampling: one threshold
per filter (on quasar's kernel top-k and top-p find theirs by octaves of the weights and a selection inside
one octave; torch's partial selection elsewhere), weights computed only for the rows rejection sampling
reaches, one uniform number inverted through a float64 running sum, in buffers the request reuses.
Both run interleaved in one process on the same logits; we report median microseconds and the ratio.

    python bench/bench_sampler.py --rounds 300
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from quasar.decoding.sampling import Sampler, SamplingParams
from quasar.decoding.rejection import rejection_sample

V = 49152
SETTINGS = {
    "T=1": SamplingParams(temperature=1.0),
    "T=0.7 top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "T=0.7 top_k=50": SamplingParams(temperature=0.7, top_k=50),
    "T=0.8 min_p=0.05": SamplingParams(temperature=0.8, min_p=0.05),
}


def sorted_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The baseline: every row, a full sort for top-p."""
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs


def old_step(logits: torch.Tensor, draft: list[int], params: SamplingParams, generator: torch.Generator) -> int:
    """The old verify step: probabilities of all k + 1 rows, then accept/reject, then multinomial."""
    probs = sorted_probs(logits, params)  # [k + 1, V]
    k = len(draft)
    accept = torch.rand(k, generator=generator) < probs[torch.arange(k), torch.tensor(draft, dtype=torch.long)]
    accepted = int(accept.to(torch.int64).cumprod(0).sum())
    row = probs[accepted].clone()
    if accepted < k:
        row[draft[accepted]] = 0.0
    return int(torch.multinomial(row, 1, generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"V={V}, {torch.get_num_threads()} threads; median microseconds per verify step's sampling")
    print("| setting | rows | sorted | quasar | ratio |\n|---|---|---|---|---|")
    for name, params in SETTINGS.items():
        for rows in (1, 6):
            logits = torch.randn(rows, V) * 4  # [k + 1, V]
            draft = torch.randint(0, V, (rows - 1,)).tolist()  # random drafts: rejected at once, the usual case at T = 1
            sampler, generator = Sampler(params), torch.Generator().manual_seed(0)
            times: dict[str, list[float]] = {"sorted": [], "quasar": []}
            for _ in range(args.rounds):
                start = time.perf_counter()
                old_step(logits, draft, params, generator)
                middle = time.perf_counter()
                rejection_sample(draft, None, sampler.rows(logits), sampler.generator)
                end = time.perf_counter()
                times["sorted"].append(middle - start)
                times["quasar"].append(end - middle)
            old, new = (statistics.median(times[key]) * 1e6 for key in ("sorted", "quasar"))
            print(f"| {name} | {rows} | {old:.0f} | {new:.0f} | {old / new:.1f}x |")


if __name__ == "__main__":
    main()
