"""EASGD's communication and throughput against sync mode; async EASGD with a slow rank
(docs/easgd.md).

    python -m benchmarks.easgd [--hosts 2] [--bandwidth 1gbit] [--repeats 1] [--taus 1 4 16]
                               [--slow-repeats 3] [--slow-kind sleep|spin]
                               [--width 1024] [--layers 4] [--batch 64] [--warmup 4] [--steps 48]

On emulated hosts (links shaped to --bandwidth) Keras fit trains an MLP in sync mode and in
both EASGD forms for each τ (α = 0.9/hosts); per configuration every rank's bytes sent per
step during fit (the engine's records, and async EASGD's exchange counters, on rank 0 with the
holder's replies), its mean step and samples/s over its own timed steps, and the throughput
relative to sync mode with every gradient all-reduced (sfb="never"; the defaults are shown
too). Then async EASGD (τ = the middle one of --taus) runs with one rank slowed 3× — the worker
adds twice that rank's unslowed mean step before each of its steps — once slowing a worker (the
last rank) and once rank 0, which also holds the center, in --slow-repeats rounds that each
also run it unslowed; the other ranks' throughput is compared with the same round's unslowed
figure (the goal: ≥ 90%). The same slowdown under sync mode and synchronous EASGD shows what
waiting for the slowest rank costs. With --repeats R a configuration's figures are those of
the run whose slowest rank is the median. A benchmark, not a test.
"""

from __future__ import annotations

import statistics
import sys

from benchmarks import runner


def add_args(p) -> None:
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--taus", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--slow-repeats", type=int, default=3,
                   help="rounds of (unslowed, each rank slowed) for the slowdown ratios")
    p.add_argument("--slow-kind", choices=["sleep", "spin"], default="sleep")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="rows per rank and step")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=48, help="timed steps")


def per_rank(result: dict) -> list[dict]:
    """Each rank's own figures: bytes sent per step of fit, mean step, samples/s."""
    out = []
    for r in result["per_rank"]:
        sent, mode = r["engine_bytes_sent"], r.get("mode_stats") or {}
        if mode.get("form") == "async":
            sent += mode["bytes_sent"] + mode.get("served", {}).get("bytes_sent", 0)
        out.append({"rank": r["rank"], "bytes_sent_per_step": sent / (r["warmup"] + r["steps"]),
                    "mean_step_s": r["window_s"] / r["steps"],
                    "samples_per_s": r["steps"] * r["batch"] / r["window_s"]})
    return out


def measure(args, bench: runner.Bench) -> dict:
    size, rows = args.hosts, []
    alpha = round(0.9 / size, 3)
    worker = {"model": "mlp", "width": args.width, "layers": args.layers, "batch": args.batch,
              "warmup": args.warmup, "steps": args.steps}

    def run(name: str, options: dict, slow_rank: int | None = None, slow_s: float = 0.0):
        slow = {} if slow_rank is None else {"straggler": slow_rank, "delay": f"{slow_s:.4f}"}
        if slow and args.slow_kind == "spin":
            slow["spin"] = True
        job = runner.Job("poseidon", size, {**worker, **slow}, options)
        runs = sorted(map(per_rank, bench.repeat(cluster, {name: job}, args.repeats)[name]),
                      key=lambda ranks: min(r["samples_per_s"] for r in ranks))
        rows.append({"name": name, "ranks": runs[len(runs) // 2]})
        return rows[-1]["ranks"]

    with bench.hosts(size, args.bandwidth) as cluster:
        sync = run("sync (sfb=never: every gradient all-reduced)", {"mode": "sync",
                                                                    "sfb": "never"})
        run("sync (defaults: sfb=auto)", {"mode": "sync"})
        unslowed = {}
        for tau in args.taus:
            run(f"easgd tau={tau}", {"mode": "easgd", "tau": tau, "alpha": alpha})
            unslowed[tau] = run(f"easgd async tau={tau}", {"mode": "easgd", "tau": tau,
                                                           "alpha": alpha, "easgd_async": True})
        tau = args.taus[len(args.taus) // 2]
        async_options = {"mode": "easgd", "tau": tau, "alpha": alpha, "easgd_async": True}
        # Rounds interleave an unslowed run with each slowed one, so the machine's drifting
        # load hits both alike; the ratio is taken within a round, then the median.
        slow_s = {r: 2 * unslowed[tau][r]["mean_step_s"] for r in (size - 1, 0)}
        ratios = {r: [] for r in slow_s}
        for round_ in range(1, args.slow_repeats + 1):
            base = run(f"easgd async tau={tau} (round {round_})", async_options)
            for r in slow_s:
                slowed = run(f"easgd async tau={tau}, rank {r} slowed 3x (round {round_})",
                             async_options, r, slow_s[r])
                ratios[r].append({o["rank"]: o["samples_per_s"] / b["samples_per_s"]
                                  for o, b in zip(slowed, base) if o["rank"] != r})
        last = size - 1
        run(f"sync (sfb=never), rank {last} slowed 3x", {"mode": "sync", "sfb": "never"}, last,
            2 * sync[last]["mean_step_s"])
        run(f"easgd tau={tau}, rank {last} slowed 3x", {"mode": "easgd", "tau": tau,
                                                        "alpha": alpha},
            last, 2 * sync[last]["mean_step_s"])
    return {"hosts": size, "bandwidth": args.bandwidth, "alpha": alpha, "tau": tau,
            "slow_kind": args.slow_kind, "rows": rows, "slow_s": slow_s, "ratios": ratios}


def table(results: dict) -> list[str]:
    rows, tau = results["rows"], results["tau"]
    sync_rate = sum(r["samples_per_s"] for r in rows[0]["ranks"])
    sync_slowest = min(r["samples_per_s"] for r in rows[0]["ranks"])
    join = lambda ranks, key, fmt, scale=1: " / ".join(f"{r[key] / scale:{fmt}}" for r in ranks)
    lines = [f"{results['hosts']} emulated hosts at {results['bandwidth']}, alpha = "
             f"{results['alpha']}, slowdown by {results['slow_kind']}", "",
             "| configuration | MB sent per step (per rank) | mean step (s) per rank | "
             "samples/s per rank | all ranks' samples/s vs sync | slowest rank vs sync |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        ranks = row["ranks"]
        lines.append(f"| {row['name']} | {join(ranks, 'bytes_sent_per_step', '.2f', 1e6)} | "
                     f"{join(ranks, 'mean_step_s', '.3f')} | {join(ranks, 'samples_per_s', '.1f')}"
                     f" | {sum(r['samples_per_s'] for r in ranks) / sync_rate:.2f} | "
                     f"{min(r['samples_per_s'] for r in ranks) / sync_slowest:.2f} |")
    lines += ["", f"Async EASGD, tau={tau}, one rank slowed 3x: each other rank's samples/s in "
              "the slowed run as a fraction of its samples/s in the same round's unslowed run; "
              "median over the rounds, then every round (goal >= 0.90)", "",
              "| slowed rank | added per step (s) | other ranks: slowed / unslowed, median "
              "(rounds) |", "|---|---|---|"]
    for r, rounds in results["ratios"].items():
        kept = [f"rank {o}: {statistics.median(x[o] for x in rounds):.2f} ("
                + ", ".join(f"{x[o]:.2f}" for x in rounds) + ")" for o in sorted(rounds[0])]
        lines.append(f"| {r}{' (holds the center)' if str(r) == '0' else ''} | "
                     f"{results['slow_s'][r]:.3f} | " + "; ".join(kept) + " |")
    return lines


def main(argv=None) -> int:
    return runner.feature_main(argv, __doc__, add_args, measure, table)


if __name__ == "__main__":
    sys.exit(main())
