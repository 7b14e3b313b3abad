"""Benchmark: sufficient factor broadcasting (sfb="auto") vs all-reduce (sfb="never").

    python benchmarks/bench_sfb.py [--ranks 2 4] [--bandwidth 1gbit] [--steps 4] [--warmup 2]
                                   [--repeats 1] [--model ...] [--json results.json]
    python benchmarks/bench_sfb.py --from-json results.json     # the table again

On emulated clusters (tf_poseidon.testing.EmulatedCluster: one network namespace per rank,
each host's link shaped to --bandwidth), trains an FC-heavy model (default: VGG-16's
classifier head 25088→4096→4096→1000, 123.6 M parameters) at batch 32 per rank, one compute
thread per rank, and reports per configuration: median step time (slowest rank), samples/s,
bytes on the wire per step and rank (strategy.stats(), and the host's eth0 tx_bytes counter),
and the ratios auto/never. Also times one process alone (compute only, batch 32). With
--repeats R every configuration runs R times, interleaved (so drift in the machine's load hits
all alike), and the table shows medians. Prints a markdown table; --json writes every figure.
A benchmark, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

from tf_poseidon.testing import emulated_cluster

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "sfb_worker.py")
ENV = {"TF_POSEIDON_INTRA_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}


def run_config(cluster, extra: list[str], single: bool = False, timeout: float = 900) -> dict:
    if single:
        argv = [sys.executable, WORKER, "--single", *extra]
    else:
        argv = [sys.executable, "-m", "tf_poseidon.launcher", *cluster.launcher_args(1),
                sys.executable, WORKER, *extra]
    start = time.monotonic()
    result = cluster.run(argv, timeout=timeout, env={**os.environ, **ENV})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"configuration {extra} failed:\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    report = json.loads(lines[-1][len("RESULT "):])
    report["wall_s"] = time.monotonic() - start
    plan_lines = [line for line in result.stdout.splitlines()
                  if line.startswith(("SFB plan", "layer (kernel)", "fc", "predictions",
                                      "sequential", "dense", "Bytes per"))]
    report["plan_table"] = "\n".join(plan_lines)
    return report


def _median(groups: list[list[dict]]) -> list[dict]:
    """Per group of repeated runs: the run with the median step time (its figures)."""
    chosen = []
    for group in groups:
        median = statistics.median_low([r["step_time_s"] for r in group])
        chosen.append(next(r for r in group if r["step_time_s"] == median))
    return chosen


def _mb(value) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", default="", type=shlex.split,
                        help='worker arguments, e.g. --model="--model mlp --width 4096"')
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-single", action="store_true")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--from-json", help="only print the table of an earlier --json file")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            print_table(json.load(f))
        return 0
    ok, reason = emulated_cluster.available()
    if not ok:
        print(f"emulated cluster not available ({reason}); this benchmark needs it")
        return 1
    common = args.model + ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    results = {"bandwidth": args.bandwidth, "configs": [], "single_runs": []}
    for ranks in args.ranks:
        with emulated_cluster.EmulatedCluster(ranks, args.bandwidth) as cluster:
            for _ in range(args.repeats):
                if not args.no_single and (ranks == args.ranks[0]):
                    single = run_config(cluster, common, single=True)
                    results["single_runs"].append(single)
                    print(f"one process: {single['step_time_s']:.3f} s/step, "
                          f"{single['samples_per_s']:.1f} samples/s", flush=True)
                for sfb in ("never", "auto"):
                    report = run_config(cluster, common + ["--sfb", sfb])
                    results["configs"].append(report)
                    print(f"P={ranks} sfb={sfb}: {report['step_time_s']:.3f} s/step, "
                          f"{report['samples_per_s']:.1f} samples/s, "
                          f"{_mb(report['stats_bytes_sent_per_step'])} MB/step (stats), "
                          f"{_mb(report['eth0_tx_bytes_per_step'])} MB/step (eth0), "
                          f"wall {report['wall_s']:.0f} s", flush=True)
                    if sfb == "auto":
                        print(report["plan_table"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results)
    return 0


def print_table(results: dict) -> None:
    """The markdown table of ``results`` (what main collects, or a --json file of it)."""
    print(f"\n{results['bandwidth']} per host, batch 32 per rank, one compute thread per rank\n")
    runs: dict = {}
    for r in results["configs"]:
        runs.setdefault((r["ranks"], r["sfb"]), []).append(r)
    by_key = dict(zip(runs, _median(list(runs.values()))))
    single = None
    if results["single_runs"]:
        single = _median([results["single_runs"]])[0]
        print(f"one process alone: {single['step_time_s']:.3f} s/step, "
              f"{single['samples_per_s']:.1f} samples/s (median of "
              f"{len(results['single_runs'])})\n")
    print("| P | sfb | step (s) | samples/s | MB/step/rank (stats) | MB/step/rank (eth0 tx) | "
          "bytes auto/never | speed-up auto/never | step of each run (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (ranks, sfb), r in sorted(by_key.items()):
        never = by_key.get((ranks, "never"))
        ratio = speedup = "-"
        if sfb == "auto" and never:
            ratio = f"{r['stats_bytes_sent_per_step'] / never['stats_bytes_sent_per_step']:.2%}"
            if r["eth0_tx_bytes_per_step"] and never["eth0_tx_bytes_per_step"]:
                eth0 = r["eth0_tx_bytes_per_step"] / never["eth0_tx_bytes_per_step"]
                ratio += f" (eth0 {eth0:.2%})"
            speedup = f"{never['step_time_s'] / r['step_time_s']:.2f}×"
        each = ", ".join(f"{x['step_time_s']:.2f}" for x in runs[(ranks, sfb)])
        print(f"| {ranks} | {sfb} | {r['step_time_s']:.3f} | {r['samples_per_s']:.1f} | "
              f"{_mb(r['stats_bytes_sent_per_step'])} | {_mb(r['eth0_tx_bytes_per_step'])} | "
              f"{ratio} | {speedup} | {each} |")
    if single:
        each = ", ".join(f"{x['step_time_s']:.2f}" for x in results["single_runs"])
        print(f"| 1 (alone) | - | {single['step_time_s']:.3f} | {single['samples_per_s']:.1f} "
              f"| - | - | - | - | {each} |")


if __name__ == "__main__":
    sys.exit(main())
