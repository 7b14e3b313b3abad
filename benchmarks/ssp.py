"""SSP (staleness 3) against sync, without a straggler and with one rank slowed (docs/ssp.md).

    python -m benchmarks.ssp [--ranks 2 3] [--repeats 3] [--delay 0.1]
                             [--stragglers none moving fixed] [--width 1024] [--batch 128]

Keras fit of an MLP of three Dense(--width) layers, --batch rows per rank and step, 10 warm-up
and 100 timed steps, on this machine's loopback (no emulated hosts): sync and mode="ssp",
staleness=3, under each straggler condition: ``none``; ``moving`` — on one step in five one
rank sleeps --delay seconds, rank 0 the first time, then rank 1, ...; ``fixed`` — rank 0 every
time (the worker's straggler injection). Throughput runs from the first rank's start of the
first timed step to the last rank's end of the last one. Prints samples/s (median of
--repeats) and SSP / sync as the median of the --repeats pairs' ratios (the two modes run in
turn, so a drift of the machine's speed cancels pair by pair). For a moving straggler also
what a simple model expects: with step time c (sync, no straggler) and delay d, sync loses d
every five steps and SSP d/P (each rank only its own delays), so SSP / sync =
(5c + d) / (5c + d/P). (Where the ranks share cores, a rank whose peer sleeps steps faster
than c, and SSP can do better than that.) A benchmark, not a test.
"""

from __future__ import annotations

import statistics
import sys

from benchmarks import runner

MODES = {"sync": {"mode": "sync"}, "ssp3": {"mode": "ssp", "staleness": 3}}
STRAGGLERS = {"none": {}, "moving": {"straggler": "moving"}, "fixed": {"straggler": 0}}


def add_args(p) -> None:
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--delay", type=float, default=0.1)
    p.add_argument("--stragglers", nargs="+", choices=list(STRAGGLERS), default=list(STRAGGLERS))
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=128, help="rows per rank and step")
    p.add_argument("--steps", type=int, default=100, help="timed steps")


def measure(args, bench: runner.Bench) -> dict:
    out = {"delay": args.delay, "batch": args.batch, "rows": []}
    for ranks in args.ranks:
        with bench.hosts(ranks) as cluster:
            for straggler in args.stragglers:
                worker = {"model": "mlp", "width": args.width, "layers": 3,
                          "batch": args.batch, "warmup": 10, "steps": args.steps,
                          **STRAGGLERS[straggler], "delay": args.delay, "every": 5}
                runs = bench.repeat(cluster, {f"P={ranks} {straggler} {name}": runner.Job(
                    "poseidon", ranks, worker, mode) for name, mode in MODES.items()},
                                    args.repeats)
                sync, ssp = ([r["span_samples_per_s"] for r in x] for x in runs.values())
                out["rows"].append({"ranks": ranks, "straggler": straggler, "sync": sync,
                                    "ssp3": ssp})
    return out


def table(results: dict) -> list[str]:
    lines = ["| ranks | straggler | sync (samples/s) | SSP s=3 (samples/s) | SSP / sync "
             "(pairs: min–max) | model |", "|---|---|---|---|---|---|"]
    step_s, delay = {}, results["delay"]
    for row in results["rows"]:
        ranks, sync, ssp = row["ranks"], row["sync"], row["ssp3"]
        ratios = [b / a for a, b in zip(sync, ssp)]
        if row["straggler"] == "none":
            step_s[ranks] = ranks * results["batch"] / statistics.median(sync)
        model = "–"
        if row["straggler"] == "moving" and ranks in step_s:
            model = f"{(5 * step_s[ranks] + delay) / (5 * step_s[ranks] + delay / ranks):.2f}"
        lines.append(f"| {ranks} | {row['straggler']} | {statistics.median(sync):.0f} | "
                     f"{statistics.median(ssp):.0f} | {statistics.median(ratios):.2f} "
                     f"({min(ratios):.2f}–{max(ratios):.2f}) | {model} |")
    return lines


def main(argv=None) -> int:
    return runner.feature_main(argv, __doc__, add_args, measure, table, emulated=False)


if __name__ == "__main__":
    sys.exit(main())
