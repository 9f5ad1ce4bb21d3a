"""Micro-benchmark: one linear layer at verify sizes, int8 paths vs bf16 and fp32 (a script, not a test).

Each measurement rotates through enough distinct weight matrices (> 64 MB per method, twice the 32 MB
L3 cache) that weights come from memory, as they do in a real forward pass. Median and minimum time per call.

    python bench/bench_linear.py [--rows 1,2,4,6,8,16] [--reps 60] [--threads N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from quasar.quant.int8 import INT_MM, Int8Linear, quantize_weight

SHAPES = {  # name -> (K in_features, N out_features)
    "135M gate/up 576->1536": (576, 1536),
    "135M down 1536->576": (1536, 576),
    "1.5B gate/up 1536->8960": (1536, 8960),
    "1.5B down 8960->1536": (8960, 1536),
}
WORKING_SET = 64 << 20  # bytes of weights per method, > 2x L3


def copies(K: int, N: int, bytes_per: int) -> int:
    return max(2, math.ceil(WORKING_SET / (K * N * bytes_per)))


def fbgemm_dynamic(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """PyTorch's dynamic quantized linear (fbgemm; one activation scale per tensor)."""
    try:
        from torch.ao.nn.quantized.dynamic import Linear

        layer = Linear(w.shape[1], w.shape[0], bias_=False, dtype=torch.qint8)
        scale = w.abs().amax(1) / 127
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        layer.set_weight_bias(qw, None)
        return layer
    except (RuntimeError, ImportError, AssertionError):  # engine not available on this build
        return None


def methods(K: int, N: int) -> dict[str, tuple[list, Callable]]:
    """name -> (one state per weight copy, fn(state, x_float32) -> y)."""
    w = torch.randn(N, K) / math.sqrt(K)
    n32, n16, n8 = copies(K, N, 4), copies(K, N, 2), copies(K, N, 1)
    w8 = [quantize_weight(w + 1e-3 * i)[0] for i in range(n8)]
    int8_layers = [Int8Linear.from_float(torch.nn.Linear(K, N, bias=False), "int_mm") for _ in range(n8)]
    out = {
        "fp32": ([w + 1e-3 * i for i in range(n32)], lambda s, x: F.linear(x, s)),
        "bf16": ([(w + 1e-3 * i).bfloat16() for i in range(n16)], lambda s, x: F.linear(x.bfloat16(), s)),
        "int_mm [N,K].t()": (w8, lambda s, x: INT_MM["int_mm"](x, s)),
        "int_mm [K,N]": ([q.t().contiguous() for q in w8], lambda s, x: torch._int_mm(x, s)),
        "blocked_float": (w8, lambda s, x: INT_MM["blocked_float"](x, s)),
        "Int8Linear": (int8_layers, lambda s, x: s(x)),
    }
    dyn = [fbgemm_dynamic(w + 1e-3 * i) for i in range(n8)]
    if dyn[0] is not None:
        out["fbgemm dynamic"] = (dyn, lambda s, x: s(x))
    return out


def time_us(states: list, fn: Callable, x: torch.Tensor, reps: int) -> tuple[float, float]:
    """(median, minimum) microseconds per call; the minimum is the robust figure on a shared, busy machine."""
    for s in states[:2]:
        fn(s, x)
    times = []
    for i in range(reps):
        s = states[i % len(states)]
        t = time.perf_counter()
        fn(s, x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6, min(times) * 1e6


@torch.inference_mode()
def run(rows: list[int], reps: int) -> list[dict]:
    results = []
    for shape, (K, N) in SHAPES.items():
        table = methods(K, N)
        for M in rows:
            x = torch.randn(M, K)
            x8 = torch.randint(-127, 128, (M, K), dtype=torch.int8)
            row = {"shape": shape, "M": M}
            for name, (states, fn) in table.items():
                arg = x8 if name.startswith(("int_mm", "blocked")) else x
                row[name], row[f"{name} min"] = time_us(states, fn, arg, reps)
            row["bf16/Int8Linear"] = row["bf16"] / row["Int8Linear"]
            row["bf16/Int8Linear min"] = row["bf16 min"] / row["Int8Linear min"]
            results.append(row)
            print(" | ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        del table
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,6,8,16")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; times in microseconds, median and min")
    results = run([int(r) for r in args.rows.split(",")], args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
