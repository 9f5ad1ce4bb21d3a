"""One verify forward, verifier by verifier, against the memory wall (issue 7, targets 1 and 5).

    python bench/bench_verify.py [--model default] [--w8a8 DIR] [--no-float] [--context 256] [--rounds 30]

For each verifier: the median time of one forward scoring T = 1 (a decode step) and T = 6 (a verify
step, k = 5) tokens after `context` cached tokens, in a cache of the size the engine would allocate;
the weight bytes one forward reads; the achieved bytes/s against the read bandwidth measured here; and
the W8A8 T=6 time over the bf16 T=1 time against the ideal byte ratio. Verifiers alternate forward by
forward, so slow phases of the machine hit all of them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from quasar.bench.bandwidth import bytes_per_forward, read_bandwidth
from quasar.engine import CACHE_BUCKET
from quasar.loading import load
from quasar.verifiers import load_verifier

SIZES = (1, 6)


def load_all(model: str, w8a8: str | None, floats: bool) -> dict[str, torch.nn.Module]:
    models = {"fp32": load_verifier(model, "fp32").model, "bf16 (torch F.linear)": load(model, "bf16").model} if floats else {}
    models["bf16"] = load_verifier(model, "bf16").model
    models["w8a8"] = load_verifier(w8a8 or model, "w8a8").model
    return models


@torch.inference_mode()
def measure(models: dict[str, torch.nn.Module], context: int, rounds: int) -> dict[str, dict[int, float]]:
    max_len = -(-(context + max(SIZES) + 1) // CACHE_BUCKET) * CACHE_BUCKET
    state = {}
    for name, model in models.items():
        cache = model.new_cache(max_len)
        model(torch.randint(0, model.config.vocab_size, (1, context)), cache, last_only=True)
        state[name] = cache
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in SIZES} for name in models}
    for _ in range(rounds + 2):  # two warm-up rounds
        for n in SIZES:
            for name, model in models.items():
                ids = torch.randint(0, model.config.vocab_size, (1, n))  # [1, T]
                start = time.perf_counter()
                model(ids, state[name])
                times[name][n].append(time.perf_counter() - start)
                state[name].trim(n)
    return {name: {n: statistics.median(t[2:]) for n, t in per.items()} for name, per in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--w8a8", help="a quantized checkpoint (quasar quantize) to use as the w8a8 verifier")
    parser.add_argument("--no-float", action="store_true", help="skip the fp32 and torch-bf16 rows (big models)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    models = load_all(args.model, args.w8a8, not args.no_float)
    bandwidth = read_bandwidth()
    medians = measure(models, args.context, args.rounds)
    nbytes = {name: bytes_per_forward(m) for name, m in models.items()}
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; {torch.get_num_threads()} threads; context {args.context}")
    print(f"{'verifier':24} {'MB read':>8} {'T=1 ms':>8} {'T=6 ms':>8} {'T=1 GB/s':>9} {'T=6 GB/s':>9} {'T=6 % bw':>9}")
    for name, per in medians.items():
        gbs = {n: nbytes[name] / per[n] / 1e9 for n in SIZES}
        print(f"{name:24} {nbytes[name] / 1e6:8.1f} {per[1] * 1e3:8.2f} {per[6] * 1e3:8.2f} {gbs[1]:9.2f} {gbs[6]:9.2f} "
              f"{100 * gbs[6] * 1e9 / bandwidth:8.0f}%")
    ideal = nbytes["w8a8"] / nbytes["bf16"]
    ratio = medians["w8a8"][6] / medians["bf16"][1]
    print(f"w8a8 T=6 / bf16 T=1 = {ratio:.3f}; ideal byte ratio {ideal:.3f}; ratio / ideal = {ratio / ideal:.2f} (target <= 1.15)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "bytes": nbytes, "medians": medians, "ratio": ratio, "ideal": ideal}, f, indent=2)


if __name__ == "__main__":
    main()
