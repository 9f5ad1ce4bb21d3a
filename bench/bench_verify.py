"""One verify forward, verifier by verifier, against the memory wall.

    python bench/bench_verify.py [--model default] [--w8a8 DIR] [--no-float] [--context 256] [--rounds 30]
                                 [--also w8a8:pc,w8a8:g64] [--int8-path auto|dpbusd|maddubs] [--prefetch l1,l2]
                                 [--warm]

`w8a8` is the default scheme (w8a8:g32); `--also` adds other quantized verifiers as rows. `--int8-path
maddubs` runs every W8A8 linear on the AVX2 path, to measure on a VNNI CPU what an AVX2-only CPU runs.
`--prefetch l1,l2` runs the quantized verifiers under each prefetch policy of the dpbusd loops (the first
names the plain rows, the others add rows), interleaved, to see which one this CPU kind should get.

For each verifier: the median time of one forward scoring T = 1 (a decode step) and T = 6 (a verify
step, k = 5) tokens after `context` cached tokens, in a cache of the size the engine would allocate;
the weight bytes one forward reads; the achieved bytes/s against the read bandwidth measured here; and
the W8A8 T=6 time over the bf16 T=1 time against the ideal byte ratio. Verifiers alternate forward by
forward, so slow phases of the machine hit all of them alike. Each forward starts cold, after a read of
512 MiB (`cache_sweep`), as the floor assumes: back to back, a forward finds part of the weights the one before
it read still in a large L3 and its time depends on what ran before it; `--warm` times them that way.

It also measures the compute roof: the multiply-adds per second of the int8 and the bf16 linear kernels
on a weight that stays in the last-level cache, at T rows. A forward cannot beat max(bytes / bandwidth, its
linears' multiply-adds / roof) (attention left out), so the floor says how close to the ideal byte ratio
this CPU can get at all: without VNNI, 6 rows of int8 dot products cost more than reading the weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from quasar.builder import model_source
from quasar.kernels import native
from quasar.tools.bench.bandwidth import bytes_per_forward, cache_sweep, read_bandwidth
from quasar.decoding.engine import CACHE_BUCKET
from quasar.model.loading import load
from quasar.kernels.quant_layers import pack_panels
from quasar.verifiers.registry import load_verifier

SIZES = (1, 6)
ROOF_SHAPE = (1536, 1536)  # N, K of the roof's weight: 2.4 MB int8, 4.7 MB bf16, hot in a 32 MB L3


def load_all(model: str, w8a8: str | None, floats: bool, also: list[str]) -> dict[str, torch.nn.Module]:
    models = {"fp32": load_verifier(model, "fp32").model, "bf16 (torch F.linear)": load(model, "bf16").model} if floats else {}
    models["bf16"] = load_verifier(model, "bf16").model
    models["w8a8"] = load_verifier(w8a8 or model, "w8a8").model
    models.update({name: load_verifier(model, name).model for name in also})
    return models


@torch.inference_mode()
def measure(models: dict[str, torch.nn.Module], context: int, rounds: int,
            prefetch: dict[str, str] | None = None, warm: bool = False) -> dict[str, dict[int, float]]:
    """prefetch: the policy each named verifier runs under (the kernels' own choice for the others); warm: no
    cache sweep before each forward."""
    kernel, prefetch = native.kernel(), prefetch or {}
    sweep = (lambda: None) if warm else cache_sweep()
    default = kernel.prefetch() if kernel else None
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
                if kernel:
                    kernel.use_prefetch(prefetch.get(name, default))
                sweep()
                start = time.perf_counter()
                model(ids, state[name])
                times[name][n].append(time.perf_counter() - start)
                state[name].trim(n)
    if kernel:
        kernel.use_prefetch(default)  # what follows (the compute roof) runs under the chosen policy
    return {name: {n: statistics.median(t[2:]) for n, t in per.items()} for name, per in times.items()}


def macs_per_token(model: torch.nn.Module) -> dict[str, int]:
    """Multiply-adds of one token's linears by weight kind: 'int8' (W8A8) and 'float' (bf16 or fp32; the
    lm_head, and every linear of a float verifier). The input embedding is a lookup, not a product."""
    macs = {"int8": 0, "float": 0}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if module is model.model.embed_tokens or weight is None or weight.dim() < 2:  # packed weights: 3-D, 4-D
            continue
        macs["int8" if weight.dtype == torch.int8 else "float"] += weight.numel()
    return macs


@torch.inference_mode()
def compute_roof(rows: int, reps: int = 200) -> dict[str, float]:
    """Multiply-adds per second of quasar's int8 (W8A8) and bf16 (the bf16 verifier's, packed) linear kernels at
    `rows` rows, weight hot in cache: the best a forward's linears can do once memory is not the limit."""
    kernel = native.kernel()
    N, K = ROOF_SHAPE
    x, no_bias = torch.randn(rows, K), torch.empty(0)
    w8, scale = torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N)
    w16 = pack_panels(torch.randn(N, K).bfloat16())  # as the bf16 verifier holds it
    calls = {"int8": lambda: kernel.w8a8_linear(x, w8, scale, no_bias),
             "float": lambda: kernel.bf16_linear(x, w16, no_bias)}
    roof = {}
    for name, call in calls.items():
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        roof[name] = rows * N * K / min(times)  # the minimum: the roof, not a typical call
    return roof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--w8a8", help="a quantized checkpoint (quasar quantize) to use as the w8a8 verifier")
    parser.add_argument("--no-float", action="store_true", help="skip the fp32 and torch-bf16 rows (big models)")
    parser.add_argument("--also", default="", help="comma-separated quantized verifiers to add, e.g. w8a8:pc,w8a8:g64")
    parser.add_argument("--int8-path", default="auto", help="the int8 path of every W8A8 linear: auto (the fastest "
                        "this CPU has), dpbusd, maddubs or dpbusd-emulated")
    parser.add_argument("--prefetch", default="auto", help="comma-separated prefetch policies of the dpbusd "
                        "loops (auto, l1, l2): the first for every row, each other one adds a row per quantized verifier")
    parser.add_argument("--warm", action="store_true", help="time the forwards back to back, without the cache "
                        "sweep before each (part of the weights may come from the last-level cache)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    args.model = model_source(args.model)  # resolved once: 'default', an installed name or a path
    kernel = native.kernel()
    int8_path = kernel.use_int8_path(args.int8_path) if kernel else "torch"
    also = [v for v in args.also.split(",") if v]
    models = load_all(args.model, args.w8a8, not args.no_float, also)
    policies = [p for p in args.prefetch.split(",") if p]
    prefetch = kernel.use_prefetch(policies[0]) if kernel else "-"
    extra = {}
    for policy in policies[1:] if kernel else []:
        for name in ["w8a8", *also]:
            extra[f"{name} (prefetch {policy})"] = (models[name], policy)
    models.update({row: model for row, (model, _) in extra.items()})
    bandwidth = read_bandwidth()
    medians = measure(models, args.context, args.rounds, {row: policy for row, (_, policy) in extra.items()}, args.warm)
    nbytes = {name: bytes_per_forward(m) for name, m in models.items()}
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; {torch.get_num_threads()} threads; int8 {int8_path} "
          f"(prefetch {prefetch}); context {args.context}; weights {'warm' if args.warm else 'cold'}")
    print(f"{'verifier':24} {'MB read':>8} {'T=1 ms':>8} {'T=6 ms':>8} {'T=1 GB/s':>9} {'T=6 GB/s':>9} {'T=6 % bw':>9}")
    for name, per in medians.items():
        gbs = {n: nbytes[name] / per[n] / 1e9 for n in SIZES}
        print(f"{name:24} {nbytes[name] / 1e6:8.1f} {per[1] * 1e3:8.2f} {per[6] * 1e3:8.2f} {gbs[1]:9.2f} {gbs[6]:9.2f} "
              f"{100 * gbs[6] * 1e9 / bandwidth:8.0f}%")
    ideal = nbytes["w8a8"] / nbytes["bf16"]
    ratio = medians["w8a8"][6] / medians["bf16"][1]
    print(f"w8a8 T=6 / bf16 T=1 = {ratio:.3f}; ideal byte ratio {ideal:.3f}; ratio / ideal = {ratio / ideal:.2f} (target <= 1.15)")
    floors = {}
    if kernel is not None:
        roofs = {n: compute_roof(n) for n in SIZES}
        print("compute roof (weight in cache), multiply-adds/s: " + "; ".join(
            f"T={n}: int8 {r['int8'] / 1e9:.0f} G, bf16 {r['float'] / 1e9:.0f} G" for n, r in roofs.items()))
        for name in ("bf16", "w8a8"):
            macs = macs_per_token(models[name])
            floors[name] = {n: max(nbytes[name] / bandwidth, sum(n * macs[kind] / roofs[n][kind] for kind in macs))
                            for n in SIZES}
            print(f"floor of a {name} forward (max of bytes / bandwidth and multiply-adds / roof, no attention): "
                  + ", ".join(f"T={n} {floors[name][n] * 1e3:.2f} ms" for n in SIZES))
        best = floors["w8a8"][6] / medians["bf16"][1]
        print(f"so w8a8 T=6 / bf16 T=1 can reach {best:.3f} at best here: ratio / ideal >= {best / ideal:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "int8_path": int8_path, "prefetch": prefetch, "warm": args.warm,
                       "bytes": nbytes, "medians": medians, "ratio": ratio, "ideal": ideal, "floors": floors},
                      f, indent=2)


if __name__ == "__main__":
    main()
