"""Draft trees against one chain and plain decoding, at several temperatures, interleaved in one process.

    python bench/bench_trees.py [--model default] [--verifier w8a8] [--drafter ngram] [--temperatures 0,0.7,1]
                                [--max-new-tokens 128] [--rounds 2] [--k auto] [--widths 1,auto] [--unseeded]

The quick suite's prompts (one a category, first turns), each run by every method in turn (plain, then the
drafter with each tree width: 1 is one chain), `rounds` times with other seeds, so slow phases of the machine hit
every method alike. Reports per temperature each method's tokens/s over its wall time, its ratio to plain (the
median of the per-prompt ratios and the ratio of the totals), its mean accepted tokens (tokens a step), and, over
the steps that verified a tree (every width above 1 together), how often the candidate of each depth and rank was
the one accepted once its parent was reached: what bounds the tokens a step that trees of those candidates give. Sampled requests are seeded unless
`--unseeded` (a model drafter's seeded chains are sized by the prior row costs, unseeded ones by the measured ones;
n-gram and suffix drafts, and every tree, follow the measured costs either way: their output is plain decoding's).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from quasar.api import LLM
from quasar.decoding import speculative
from quasar.decoding.sampling import SamplingParams
from quasar.tools.bench.suites import load_suite

Tally = collections.Counter  # (depth, rank) -> count


def count_walks(offered: Tally, taken: Tally) -> None:
    """Wrap speculative.verify_tree so that every tree step adds, for each node the walk reached, its children to
    `offered` and the accepted one to `taken`."""
    verify = speculative.verify_tree

    def counted(tree, *args, **kwargs):
        draft, verdict, target = yield from verify(tree, *args, **kwargs)
        path = draft.tokens[: verdict.accepted]
        node = -1
        for depth in range(1, verdict.accepted + 2):
            children = tree.children(node)
            for rank, child in enumerate(children):
                offered[depth, rank] += 1
                if depth <= verdict.accepted and tree.tokens[child] == path[depth - 1]:
                    taken[depth, rank] += 1
                    node = child
        return draft, verdict, target

    speculative.verify_tree = counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--verifier", default="w8a8")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--temperatures", default="0,0.7,1")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", default="auto")
    parser.add_argument("--widths", default="1,auto")
    parser.add_argument("--unseeded", action="store_true")
    args = parser.parse_args()
    widths = args.widths.split(",")
    methods = {"plain": LLM(args.model, args.verifier, "none", max_batch=1)}
    methods.update({f"{args.drafter}, tree {w}": LLM(args.model, args.verifier, args.drafter, k=args.k, tree=w,
                                                      max_batch=1) for w in widths})
    print(f"paths: {methods['plain'].engine.path}")
    offered, taken = Tally(), Tally()
    count_walks(offered, taken)
    prompts = [item.turns[0] for item in load_suite("quick")]
    for temperature in map(float, args.temperatures.split(",")):
        offered.clear(), taken.clear()
        tokens, seconds, steps = Tally(), Tally(), Tally()
        ratios: dict[str, list[float]] = collections.defaultdict(list)
        for round_ in range(args.rounds):
            for prompt in prompts:
                rate = {}
                for name, llm in methods.items():
                    params = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens,
                                            seed=None if args.unseeded else round_)
                    start = time.perf_counter()
                    out = llm.generate(prompt, params, chat=True)[0]
                    elapsed = time.perf_counter() - start
                    tokens[name] += len(out.token_ids)
                    seconds[name] += elapsed
                    steps[name] += out.stats.verify_steps if name != "plain" else len(out.token_ids)
                    rate[name] = len(out.token_ids) / elapsed
                for name in methods:
                    ratios[name].append(rate[name] / rate["plain"])
        print(f"\nT = {temperature:g}: {len(prompts)} prompts x {args.rounds} rounds, {args.max_new_tokens} new tokens")
        for name in methods:
            total = tokens[name] / seconds[name] / (tokens["plain"] / seconds["plain"])
            print(f"  {name:<20} {tokens[name] / seconds[name]:7.1f} tok/s  x plain: median {statistics.median(ratios[name]):.3f}, "
                  f"totals {total:.3f}  MAT {tokens[name] / steps[name]:.3f}")
        depths = sorted({d for d, _ in offered})
        for depth in depths:
            ranks = sorted(r for d, r in offered if d == depth)
            cells = "  ".join(f"r{r} {taken[depth, r]}/{offered[depth, r]} = {taken[depth, r] / offered[depth, r]:.2f}"
                              for r in ranks)
            print(f"  accepted at depth {depth}: {cells}")


if __name__ == "__main__":
    main()
