"""EASGD's communication and throughput against sync mode, and async EASGD with a slowed rank,
on emulated hosts (docs/easgd.md): per configuration and rank the bytes sent per step of fit,
mean step and samples/s, and the throughput against sync mode with every gradient all-reduced;
then async EASGD (τ: the middle one of --taus) with the last rank or rank 0 (the center holder)
sleeping twice its mean step before each step, in --slow-repeats rounds, each other rank's
samples/s against the same round's unslowed run (goal ≥ 0.90).
"""

import statistics
import sys

from benchmarks import report, runner


def measure(args, bench: runner.Bench) -> dict:
    size, rows = args.hosts, []
    alpha, tau = round(0.9 / size, 3), args.taus[len(args.taus) // 2]
    sync, easgd = {"mode": "sync", "sfb": "never"}, {"mode": "easgd", "alpha": alpha}
    async_ = easgd | {"tau": tau, "easgd_async": True}

    def run(name: str, options: dict, slowed: int | None = None, delay: float = 0.0):
        """Per rank: bytes sent per step of fit, mean step, samples/s."""
        slow = {} if slowed is None else {"straggler": slowed, "delay": f"{delay:.4f}"}
        job = runner.Job("poseidon", size, runner.model_args(args) | slow, options)
        rows.append({"name": name, "ranks": []})
        for r in bench.repeat(cluster, {name: job})[name][0]["per_rank"]:
            mode, sent = r.get("mode_stats") or {}, r["engine_bytes_sent"]
            if mode.get("form") == "async":
                sent += mode["bytes_sent"] + mode.get("served", {}).get("bytes_sent", 0)
            rows[-1]["ranks"].append({
                "rank": r["rank"], "bytes_sent_per_step": sent / (r["warmup"] + r["steps"]),
                "mean_step_s": r["window_s"] / r["steps"],
                "samples_per_s": r["steps"] * r["batch"] / r["window_s"]})
        return rows[-1]["ranks"]

    with bench.hosts(size, args.bandwidth) as cluster:
        base = run("sync (sfb=never: every gradient all-reduced)", sync)
        run("sync (defaults: sfb=auto)", {"mode": "sync"})
        unslowed = {}
        for t in args.taus:
            run(f"easgd tau={t}", easgd | {"tau": t})
            unslowed[t] = run(f"easgd async tau={t}", easgd | {"tau": t, "easgd_async": True})
        slow_s = {r: 2 * unslowed[tau][r]["mean_step_s"] for r in (size - 1, 0)}
        # Each round runs the unslowed job next to the slowed ones, so the machine's drifting
        # load hits them alike; the ratio is taken within a round, then the median.
        ratios = {r: [] for r in slow_s}
        for round_ in range(1, args.slow_repeats + 1):
            alone = run(f"easgd async tau={tau} (round {round_})", async_)
            for r in slow_s:
                slowed = run(f"easgd async tau={tau}, rank {r} slowed 3x (round {round_})",
                             async_, r, slow_s[r])
                ratios[r].append({o["rank"]: o["samples_per_s"] / b["samples_per_s"]
                                  for o, b in zip(slowed, alone) if o["rank"] != r})
        last = size - 1
        run(f"sync (sfb=never), rank {last} slowed 3x", sync, last, 2 * base[last]["mean_step_s"])
        run(f"easgd tau={tau}, rank {last} slowed 3x", easgd | {"tau": tau}, last,
            2 * base[last]["mean_step_s"])
    return {"hosts": size, "bandwidth": args.bandwidth, "alpha": alpha, "tau": tau,
            "rows": rows, "slow_s": slow_s, "ratios": ratios}


def table(results: dict) -> list[str]:
    def each(ranks, key, fmt, scale=1):
        return " / ".join(f"{r[key] / scale:{fmt}}" for r in ranks)

    base = results["rows"][0]["ranks"]
    vs_sync = lambda ranks, f: f(r["samples_per_s"] for r in ranks) / f(  # noqa: E731
        r["samples_per_s"] for r in base)
    slowed = [[f"{r}{' (holds the center)' if str(r) == '0' else ''}",
               f"{results['slow_s'][r]:.3f}", "; ".join(
                   f"rank {o}: {statistics.median(x[o] for x in rounds):.2f} ("
                   + ", ".join(f"{x[o]:.2f}" for x in rounds) + ")" for o in sorted(rounds[0]))]
              for r, rounds in results["ratios"].items()]
    return [f"{results['hosts']} emulated hosts at {results['bandwidth']}, alpha = "
            f"{results['alpha']}", "", *report.table(
                ["configuration", "MB sent per step (per rank)", "mean step (s) per rank",
                 "samples/s per rank", "all ranks' samples/s vs sync", "slowest rank vs sync"],
                [[row["name"], each(row["ranks"], "bytes_sent_per_step", ".2f", 1e6),
                  each(row["ranks"], "mean_step_s", ".3f"),
                  each(row["ranks"], "samples_per_s", ".1f"),
                  f"{vs_sync(row['ranks'], sum):.2f}", f"{vs_sync(row['ranks'], min):.2f}"]
                 for row in results["rows"]]),
            "", f"Async EASGD, tau={results['tau']}, one rank slowed 3x: each other rank's "
            "samples/s in the slowed run as a fraction of its samples/s in the same round's "
            "unslowed run; median over the rounds, then every round (goal >= 0.90)", "",
            *report.table(["slowed rank", "added per step (s)",
                           "other ranks: slowed / unslowed, median (rounds)"], slowed)]


if __name__ == "__main__":
    sys.exit(runner.feature_main(__doc__, measure, table, hosts=2, bandwidth="1gbit",
                                 taus=[1, 4, 16], slow_repeats=3, width=1024, layers=4, batch=64,
                                 warmup=4, steps=48))
