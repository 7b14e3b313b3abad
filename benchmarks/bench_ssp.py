"""Benchmark: SSP (staleness 3) vs sync with and without an intermittent straggler.

    python benchmarks/bench_ssp.py [--ranks 2 3] [--repeats 3] [--delay 0.1]

Runs benchmarks/workers/ssp_worker.py with tfposeidon-run on this machine (loopback): sync and
mode="ssp", staleness=3, each with rank 0 slowed by --delay seconds on one step in five (the
slowdown is injected by the benchmark's own callback) and without; prints samples/s (median of
--repeats, interleaved) and the ratios. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "ssp_worker.py")


def measure(ranks: int, args: list[str]) -> float:
    argv = [sys.executable, "-m", "tf_poseidon.launcher", "-np", str(ranks), sys.executable,
            WORKER, *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{args} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])["samples_per_s"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.1)
    args = parser.parse_args(argv)
    configs = {"sync": ["--mode", "sync"], "ssp3": ["--mode", "ssp", "--staleness", "3"]}
    print("| ranks | straggler | sync (samples/s) | SSP s=3 (samples/s) | SSP / sync |")
    print("|---|---|---|---|---|")
    for ranks in args.ranks:
        for straggle in (True, False):
            extra = ["--straggle", "--delay", str(args.delay)] if straggle else []
            runs = {name: [] for name in configs}
            for _ in range(args.repeats):
                for name, config in configs.items():
                    runs[name].append(measure(ranks, config + extra))
            sync, ssp = (statistics.median(runs[name]) for name in configs)
            print(f"| {ranks} | {'yes' if straggle else 'no'} | {sync:.0f} | {ssp:.0f} | "
                  f"{ssp / sync:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
