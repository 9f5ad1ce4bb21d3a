"""Peak resident memory of each verifier, loaded in a fresh process and run for one decode step
(e.g. a W8A8 verifier loaded from its quantized checkpoint against the bf16 model).

    python bench/bench_memory.py --model qwen2.5-coder-1.5b --w8a8 DIR [--verifiers bf16,w8a8,w4a8]

Each verifier runs in its own subprocess (peak RSS is per process); reported: peak RSS over loading and
the step (ru_maxrss), and the RSS after the step (what serving holds).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys, torch
from quasar.builder import model_source
from quasar.verifiers.registry import load_verifier
model = load_verifier(model_source(sys.argv[1]), sys.argv[2]).model
cache = model.new_cache(256)
with torch.inference_mode():
    model(torch.tensor([[1, 2, 3, 4]]), cache)
    model(torch.tensor([[5]]), cache)
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_mb": rss / 2**20}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--w8a8", help="a quantized checkpoint to load as the w8a8 verifier (default: on the fly)")
    parser.add_argument("--verifiers", default="bf16,w8a8")
    args = parser.parse_args()
    results = {}
    for verifier in args.verifiers.split(","):
        model = args.w8a8 if verifier == "w8a8" and args.w8a8 else args.model
        out = subprocess.run([sys.executable, "-c", CHILD, model, verifier], capture_output=True, text=True, check=True)
        results[verifier] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{verifier:8} peak {results[verifier]['peak_mb']:8.0f} MB   after one step {results[verifier]['rss_mb']:8.0f} MB")
    if "bf16" in results:
        for verifier in (v for v in results if v != "bf16"):
            ratio = results[verifier]["peak_mb"] / results["bf16"]["peak_mb"]
            held = results[verifier]["rss_mb"] / results["bf16"]["rss_mb"]
            print(f"{verifier} / bf16: peak {ratio:.2f}, held {held:.2f}")


if __name__ == "__main__":
    main()
