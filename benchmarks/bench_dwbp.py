"""Benchmark: wait-free backprop (overlap) vs communicating after the backward pass.

    python benchmarks/bench_dwbp.py [--bandwidth 1gbit] [--repeats 3] [--bucket-mb 1 4 16 64]

On an emulated cluster of 2 hosts (tf_poseidon.testing.EmulatedCluster: one network namespace
per rank, links shaped to --bandwidth), trains an MLP whose gradient all-reduce takes about as
long as its backward pass, and reports per configuration the median step time, the fraction of
communication time hidden behind the backward pass (strategy.stats()), and the step-time ratio
of overlap vs overlap=False. Also times one process alone (compute only). Results go to stdout
as a markdown table. This is a benchmark, not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

from tf_poseidon.testing import emulated_cluster

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "dwbp_worker.py")


def run_config(cluster, extra: list[str], single: bool = False) -> dict:
    env = {"TF_POSEIDON_INTRA_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}
    if single:
        argv = [sys.executable, WORKER, "--single", *extra]
    else:
        argv = [sys.executable, "-m", "tf_poseidon.launcher", *cluster.launcher_args(1),
                sys.executable, WORKER, *extra]
    result = cluster.run(argv, timeout=900, env={**os.environ, **env})
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"configuration {extra} failed:\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[4.0])
    parser.add_argument("--model", default="", type=shlex.split,
                        help='worker arguments, e.g. --model="--width 2048 --layers 6 --batch 256"')
    args = parser.parse_args(argv)
    ok, reason = emulated_cluster.available()
    if not ok:
        print(f"emulated cluster not available ({reason}); this benchmark needs it")
        return 1
    rows = []
    with emulated_cluster.EmulatedCluster(2, args.bandwidth) as cluster:
        single = [run_config(cluster, args.model, single=True)["step_time_s"]
                  for _ in range(args.repeats)]
        print(f"one process (compute only): median {statistics.median(single):.3f} s/step",
              flush=True)
        for bucket_mb in args.bucket_mb:
            bucket = ["--bucket-bytes", str(int(bucket_mb * 2**20))]
            runs = {"overlap": [], "no_overlap": []}
            hidden = []
            for _ in range(args.repeats):  # interleaved, so drift hits both alike
                with_overlap = run_config(cluster, args.model + bucket)
                runs["overlap"].append(with_overlap["step_time_s"])
                hidden.append(with_overlap["comm"]["hidden_fraction"])
                runs["no_overlap"].append(
                    run_config(cluster, args.model + bucket + ["--no-overlap"])["step_time_s"])
            row = (bucket_mb, statistics.median(runs["overlap"]),
                   statistics.median(runs["no_overlap"]), statistics.median(hidden),
                   with_overlap["comm"]["comm_time_s"])
            rows.append(row)
            print(f"bucket {bucket_mb} MB: overlap {row[1]:.3f} s, no overlap {row[2]:.3f} s, "
                  f"hidden {row[3]:.0%}", flush=True)
    print(f"\n2 hosts at {args.bandwidth}; compute-only step {statistics.median(single):.3f} s\n")
    print("| bucket MB | step, overlap (s) | step, overlap=False (s) | overlap / naive | "
          "comm time (s) | comm hidden |")
    print("|---|---|---|---|---|---|")
    for bucket_mb, overlap, naive, hidden, comm in rows:
        print(f"| {bucket_mb:g} | {overlap:.3f} | {naive:.3f} | {overlap / naive:.2f} | "
              f"{comm:.3f} | {hidden:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
