"""Micro-benchmark: the GGUF-block linears (W4A8, W6A8) and the group-wise W8A8 one at verify sizes, on every int8
path this CPU runs (a script, not a test).

    python bench/bench_blocks.py [--rows 1,2,4,6,8,16] [--shapes 1.5b] [--paths maddubs,dpbusd] [--rounds 9]

Each weight form is timed at the 1.5B model's linear shapes with enough distinct weights (> 64 MB each) that they
come from memory, as in a forward. The paths and row counts are interleaved round by round in one process; it
prints the median time per call, the ratio to one row on the same path, and the kernel path beside every figure.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from quasar.kernels import native, plan
from quasar.model.gguf_blocks import unpack
from quasar.quant.w4a8 import W4A8Linear, W6A8Linear

SHAPES = {  # name -> (K, N)
    "1.5b": [("gate/up 1536->8960", 1536, 8960), ("down 8960->1536", 8960, 1536)],
    "default": [("gate/up 960->2560", 960, 2560), ("down 2560->960", 2560, 960)],
}
FORMS = {"Q4_K": (T.Q4_K, 256, 144), "Q6_K": (T.Q6_K, 256, 210), "Q4_0": (T.Q4_0, 32, 18), "Q5_0": (T.Q5_0, 32, 22)}
SCALES_AT = {T.Q4_0: slice(0, 2), T.Q5_0: slice(0, 2), T.Q4_K: slice(0, 4), T.Q6_K: slice(208, 210)}
WORKING_SET = 64 << 20


def random_layer(qtype, N: int, K: int, seed: int):
    size, width = next((s, w) for q, s, w in FORMS.values() if q == qtype)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // size, width), dtype=np.uint8)
    at = SCALES_AT[qtype]
    halves = rng.normal(0, 0.02, (N, K // size, (at.stop - at.start) // 2)).astype(np.float16)
    raw[..., at] = halves.view(np.uint8).reshape(N, K // size, -1)
    blocks = unpack(raw.reshape(N, -1), qtype, N)
    layer = (W6A8Linear if qtype == T.Q6_K else W4A8Linear).from_blocks(blocks)
    return plan.on_kernel(layer).kernel_weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,6,8,16")
    parser.add_argument("--shapes", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--forms", default="Q4_K,Q6_K", help=f"comma-separated, of {', '.join(FORMS)}")
    parser.add_argument("--paths", default="", help="comma-separated int8 paths (default: every path this CPU runs)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=0, help="threads (default: torch's)")
    parser.add_argument("--calls", type=int, default=20, help="calls a timing (each on the next weight copy)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = native.kernel()
    if kernel is None:
        raise SystemExit("the kernels did not build on this machine")
    paths = args.paths.split(",") if args.paths else kernel.int8_paths()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {torch.get_num_threads()}, int8 paths {paths}, CPU paths available {kernel.int8_paths()}")
    for form in args.forms.split(","):
        qtype = FORMS[form][0]
        for name, K, N in SHAPES[args.shapes]:
            layers = []
            per = N * K * FORMS[form][2] / FORMS[form][1]
            for i in range(max(2, math.ceil(WORKING_SET / per))):
                layers.append(random_layer(qtype, N, K, i))
            empty = torch.empty(0)
            times: dict[tuple[str, int], list[float]] = {(p, m): [] for p in paths for m in rows}
            xs = {m: torch.randn(m, K) for m in rows}
            for _ in range(args.rounds):
                for path in paths:
                    for m in rows:
                        kernel.block_linear_on(path, xs[m], [layers[0][0]], [layers[0][1]], [empty])
                        start = time.perf_counter()
                        for c in range(args.calls):
                            w, s = layers[c % len(layers)]
                            kernel.block_linear_on(path, xs[m], [w], [s], [empty])
                        times[(path, m)].append((time.perf_counter() - start) / args.calls)
            print(f"\n{form} {name} ({len(layers)} copies)")
            print("path      " + "".join(f"{m:>10} rows" for m in rows))
            for path in paths:
                med = [statistics.median(times[(path, m)]) * 1e3 for m in rows]
                print(f"{path:<10}" + "".join(f"{t:>10.3f} ms " for t in med))
                print(f"{'  / 1 row':<10}" + "".join(f"{t / med[0]:>10.2f} x  " for t in med))


if __name__ == "__main__":
    main()
