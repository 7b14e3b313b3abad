"""Benchmark: EASGD's communication and throughput vs sync mode; async EASGD with a slow rank.

    python benchmarks/bench_easgd.py [--hosts 2] [--bandwidth 1gbit] [--repeats 1]
                                     [--taus 1 4 16] [--slow-kind sleep|spin]

On an emulated cluster (tf_poseidon.testing.EmulatedCluster: one network namespace per rank,
every link shaped to --bandwidth) an MLP is trained with Keras fit (benchmarks/workers/
easgd_worker.py) in sync mode and in both EASGD forms for each τ; per configuration every
rank's bytes sent per step, mean step time and samples/s over its own timed steps are
reported, and the throughput relative to sync mode with every gradient all-reduced
(sfb="never"; the defaults, with sufficient factors, are shown too). Then async EASGD (τ = the
middle one of --taus) runs with one rank slowed 3× — the benchmark adds twice that rank's
unslowed mean step time to each of its steps, in a Keras callback — once slowing a worker (the
last rank) and once rank 0, which also holds the center, in --slow-repeats rounds that each
also run it unslowed; the other ranks' throughput is compared with the same round's unslowed
figure (the goal: ≥ 90%). The same slowdown under sync mode and
synchronous EASGD shows what waiting for the slowest rank costs. Results: markdown on stdout.
A benchmark, not a test: the numbers depend on the machine and its load (printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from tf_poseidon.testing import emulated_cluster

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "easgd_worker.py")


def run_config(cluster, options: dict, extra: list[str]) -> list[dict]:
    """One job; every rank's RESULT, in rank order."""
    env = {**os.environ, "TF_POSEIDON_INTRA_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}
    argv = [sys.executable, "-m", "tf_poseidon.launcher", *cluster.launcher_args(1),
            sys.executable, WORKER, "--options", json.dumps(options), *extra]
    result = cluster.run(argv, timeout=600, env=env)
    reports = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines()
               if line.startswith("RESULT ")]
    if result.returncode != 0 or len(reports) != len(cluster.hosts):
        raise RuntimeError(f"configuration {options} {extra} failed:\n{result.stdout[-3000:]}"
                           f"\n{result.stderr[-3000:]}")
    return sorted(reports, key=lambda r: r["rank"])


def median_runs(cluster, options: dict, extra: list[str], repeats: int) -> list[dict]:
    """Per rank, the run (of ``repeats``) with the median samples/s of the slowest rank."""
    runs = [run_config(cluster, options, extra) for _ in range(repeats)]
    runs.sort(key=lambda ranks: min(r["samples_per_s"] for r in ranks))
    return runs[len(runs) // 2]


def load() -> str:
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--taus", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--slow-repeats", type=int, default=3,
                        help="rounds of (unslowed, each rank slowed) for the slowdown ratios")
    parser.add_argument("--slow-kind", choices=["sleep", "spin"], default="sleep")
    parser.add_argument("--worker-args", default="", help='e.g. "--width 1024 --layers 4"')
    args = parser.parse_args(argv)
    ok, reason = emulated_cluster.available()
    if not ok:
        print(f"emulated cluster not available ({reason}); this benchmark needs it")
        return 1
    size = args.hosts
    alpha = round(0.9 / size, 3)
    extra = args.worker_args.split()
    started = time.monotonic()
    rows: list[tuple[str, list[dict]]] = []

    def measure(name: str, options: dict, more: list[str] = ()) -> list[dict]:
        ranks = median_runs(cluster, options, extra + list(more), args.repeats)
        rows.append((name, ranks))
        print(f"{name}: " + ", ".join(f"rank {r['rank']} {r['samples_per_s']:.1f} samples/s "
                                      f"{r['bytes_sent_per_step'] / 1e6:.2f} MB/step"
                                      for r in ranks) + f"  (load {load()})", flush=True)
        return ranks

    print(f"{size} hosts at {args.bandwidth}; load average at start {load()}", flush=True)
    with emulated_cluster.EmulatedCluster(size, args.bandwidth) as cluster:
        sync = measure("sync (sfb=never: every gradient all-reduced)",
                       {"mode": "sync", "sfb": "never"})
        measure("sync (defaults: sfb=auto)", {"mode": "sync"})
        unslowed = {}
        for tau in args.taus:
            measure(f"easgd tau={tau}", {"mode": "easgd", "tau": tau, "alpha": alpha})
            unslowed[tau] = measure(f"easgd async tau={tau}",
                                    {"mode": "easgd", "tau": tau, "alpha": alpha,
                                     "easgd_async": True})
        tau = args.taus[len(args.taus) // 2]
        async_options = {"mode": "easgd", "tau": tau, "alpha": alpha, "easgd_async": True}
        # Slowing rank R by 3x: add twice R's unslowed mean step. Rounds interleave an
        # unslowed run with each slowed one, so the machine's drifting load hits both alike;
        # the ratio is taken within a round, then the median over rounds.
        slow_ranks = (size - 1, 0)
        slow_s = {r: 2 * unslowed[tau][r]["mean_step_s"] for r in slow_ranks}
        ratios = {r: [] for r in slow_ranks}
        for round_ in range(args.slow_repeats):
            base = measure(f"easgd async tau={tau} (round {round_ + 1})", async_options)
            for r in slow_ranks:
                more = ["--slow-rank", str(r), "--slow-s", f"{slow_s[r]:.4f}",
                        "--slow-kind", args.slow_kind]
                slowed = measure(f"easgd async tau={tau}, rank {r} slowed 3x "
                                 f"(round {round_ + 1})", async_options, more)
                ratios[r].append({o["rank"]: o["samples_per_s"] / b["samples_per_s"]
                                  for o, b in zip(slowed, base) if o["rank"] != r})
        slow_rank = size - 1
        more = ["--slow-rank", str(slow_rank),
                "--slow-s", f"{2 * sync[slow_rank]['mean_step_s']:.4f}",
                "--slow-kind", args.slow_kind]
        measure(f"sync (sfb=never), rank {slow_rank} slowed 3x", {"mode": "sync", "sfb": "never"},
                more)
        measure(f"easgd tau={tau}, rank {slow_rank} slowed 3x",
                {"mode": "easgd", "tau": tau, "alpha": alpha}, more)

    params = sync[0]["parameters"]
    sync_rate = sum(r["samples_per_s"] for r in sync)
    sync_slowest = min(r["samples_per_s"] for r in sync)
    print(f"\n{size} emulated hosts at {args.bandwidth}, {params / 1e6:.2f} M parameters "
          f"({params * 4 / 1e6:.1f} MB fp32), alpha = {alpha}, slowdown by {args.slow_kind}; "
          f"wall {time.monotonic() - started:.0f} s; load average at the end {load()}\n")
    print("| configuration | MB sent per step (per rank) | mean step (s) per rank | "
          "samples/s per rank | all ranks' samples/s vs sync | slowest rank vs sync |")
    print("|---|---|---|---|---|---|")
    for name, ranks in rows:
        rate = sum(r["samples_per_s"] for r in ranks)
        slowest = min(r["samples_per_s"] for r in ranks)
        print(f"| {name} | " + " / ".join(f"{r['bytes_sent_per_step'] / 1e6:.2f}"
                                          for r in ranks)
              + " | " + " / ".join(f"{r['mean_step_s']:.3f}" for r in ranks)
              + " | " + " / ".join(f"{r['samples_per_s']:.1f}" for r in ranks)
              + f" | {rate / sync_rate:.2f} | {slowest / sync_slowest:.2f} |")
    print(f"\nAsync EASGD, tau={tau}, one rank slowed 3x: each other rank's samples/s in the "
          "slowed run as a fraction of its samples/s in the same round's unslowed run; median "
          f"over {args.slow_repeats} rounds, then every round (goal >= 0.90)\n")
    print("| slowed rank | added per step (s) | other ranks: slowed / unslowed, median "
          "(rounds) |")
    print("|---|---|---|")
    for r in slow_ranks:
        others = sorted(ratios[r][0])
        kept = [f"rank {o}: {statistics.median(x[o] for x in ratios[r]):.2f} ("
                + ", ".join(f"{x[o]:.2f}" for x in ratios[r]) + ")" for o in others]
        print(f"| {r}{' (holds the center)' if r == 0 else ''} | {slow_s[r]:.3f} | "
              + "; ".join(kept) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
