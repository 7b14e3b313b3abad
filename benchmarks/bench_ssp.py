"""Benchmark: SSP (staleness 3) vs sync, without a straggler and with one rank slowed.

    python -m benchmarks.bench_ssp [--ranks 2 3] [--repeats 3] [--delay 0.1]
                                   [--stragglers none moving fixed] [--width 1024] [--batch 128]

Runs benchmarks/workers/ssp_worker.py (Keras fit of a 3×Dense(--width) MLP, --batch rows per
rank and step) with tfposeidon-run on this machine (loopback): sync and mode="ssp",
staleness=3, under each straggler condition: ``none``; ``moving`` — on one step in
five one rank sleeps --delay seconds, rank 0 the first time, then rank 1, ...; ``fixed`` — rank
0 every time. The slowdown is injected by the benchmark's own Keras callback. Prints samples/s
(median of --repeats) and SSP / sync as the median of the ratios of the --repeats pairs (the
two modes run in turn, so a drift of the machine's speed cancels pair by pair). For a moving
straggler it also prints what a simple model expects: with step time c (sync, no straggler)
and delay d, sync loses d every five steps and SSP d/P (each rank only its own delays), so
SSP / sync = (5c + d) / (5c + d/P). (Where the ranks share cores, as on one machine, a rank
whose peer sleeps steps faster than c, and SSP can do better than that.) A benchmark, not a
test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "ssp_worker.py")
MODES = {"sync": ["--mode", "sync"], "ssp3": ["--mode", "ssp", "--staleness", "3"]}


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
    parser.add_argument("--stragglers", nargs="+", choices=["none", "moving", "fixed"],
                        default=["none", "moving", "fixed"])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128, help="rows per rank and step")
    args = parser.parse_args(argv)
    print("| ranks | straggler | sync (samples/s) | SSP s=3 (samples/s) | SSP / sync "
          "(pairs: min–max) | model |")
    print("|---|---|---|---|---|---|")
    for ranks in args.ranks:
        step_s = None  # sync's step time without a straggler, for the model
        for straggler in args.stragglers:
            extra = ["--straggler", straggler, "--delay", str(args.delay),
                     "--width", str(args.width), "--batch", str(args.batch)]
            runs = {name: [] for name in MODES}
            for _ in range(args.repeats):
                for name, mode in MODES.items():
                    runs[name].append(measure(ranks, mode + extra))
            sync, ssp = (statistics.median(runs[name]) for name in MODES)
            ratios = [b / a for a, b in zip(runs["sync"], runs["ssp3"])]
            if straggler == "none":
                step_s = ranks * args.batch / sync
            model = "–"
            if straggler == "moving" and step_s is not None:
                model = f"{(5 * step_s + args.delay) / (5 * step_s + args.delay / ranks):.2f}"
            print(f"| {ranks} | {straggler} | {sync:.0f} | {ssp:.0f} | "
                  f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) | "
                  f"{model} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
