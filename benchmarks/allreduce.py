"""All-reduce times between emulated hosts: Open MPI's own (docs/cluster.md) and through
tf_poseidon's codecs (docs/compression.md).

    python -m benchmarks.allreduce [--bandwidth 1gbit ...] [--hosts 2] [--loopback]
                                   [--codecs mpi | --codecs none fp16 bf16] [--megabytes 64]
                                   [--repeats 5] [--small-repeats 500] [--bind-to none]
                                   [--mpi-args "..."]

Per bandwidth ("none": unshaped) one cluster of --hosts hosts (--loopback: 2 ranks on one
namespace's shaped ``lo``) runs one job that, per codec and after warm-ups, times --repeats
all-reduces of --megabytes MiB of float32 and --small-repeats of 1 KB, each after a barrier.
``mpi``: mpi4py's ``Allreduce`` in ranks that never import tf_poseidon, under plain ``mpirun``
(--bind-to, --mpi-args); a codec name: the engine's all-reduce through that codec, under
tfposeidon-run. Prints per codec the slowest rank's median and best time, the speed-up over the
first codec, the bytes each rank sends and their time at the link rate (the floor), and the
1 KB median. A benchmark, not a test.
"""

from __future__ import annotations

import shlex
import statistics
import sys

from benchmarks import runner
from benchmarks.report import rate_bits


def add_args(p) -> None:
    p.add_argument("--bandwidth", nargs="+", default=["1gbit"])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--loopback", action="store_true",
                   help="2 ranks on one shaped loopback (ShapedLoopback) instead of hosts")
    p.add_argument("--codecs", nargs="+", default=["mpi"])
    p.add_argument("--megabytes", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--small-repeats", type=int, default=500)
    p.add_argument("--bind-to", default="none",
                   help="mpirun's --bind-to (Open MPI's own default binds to cores)")
    p.add_argument("--mpi-args", default="", help="extra mpirun arguments")


def measure(args, bench: runner.Bench) -> dict:
    ranks = 2 if args.loopback else args.hosts
    out = {"ranks": ranks, "where": "loopback" if args.loopback else f"{args.hosts} hosts",
           "megabytes": args.megabytes, "rows": []}
    mpi = args.codecs == ["mpi"]
    job = runner.Job("allreduce", ranks, {
        "codecs": args.codecs, "megabytes": args.megabytes, "repeats": args.repeats,
        "small_repeats": args.small_repeats}, launch="mpirun" if mpi else "launcher",
                     mpi_args=["--bind-to", args.bind_to, *shlex.split(args.mpi_args)])
    for bandwidth in args.bandwidth:
        shaped = None if bandwidth == "none" else bandwidth
        with bench.hosts(ranks, shaped, shared_lo=args.loopback) as cluster:
            result = bench.measure(cluster, job)
        for codec in args.codecs:
            slowest = {key: [max(x) for x in zip(*(r["allreduce"][codec][key]
                                                   for r in result["per_rank"]))]
                       for key in ("big_s", "small_s")}
            out["rows"].append({"bandwidth": bandwidth, "codec": codec, **slowest})
    return out


def table(results: dict) -> list[str]:
    from tf_poseidon.comm import codecs
    elements, ranks = int(results["megabytes"] * 2**20) // 4, results["ranks"]
    lines = [f"{results['where']}, one all-reduce of {results['megabytes']:g} MiB of float32 "
             "(slowest rank; median and best) and of 1 KB (median)", "",
             "| link | codec | median (s) | best (s) | speed-up | MB sent per rank | floor (s) "
             "| 1 KB (ms) |", "|---|---|---|---|---|---|---|---|"]
    first = {}
    for r in results["rows"]:
        median = statistics.median(r["big_s"])
        first.setdefault(r["bandwidth"], median)
        sent = codecs.get("none" if r["codec"] == "mpi" else r["codec"]).wire_bytes(
            elements, ranks)[0]
        link = rate_bits(None if r["bandwidth"] == "none" else r["bandwidth"])
        small = f"{1e3 * statistics.median(r['small_s']):.3f}" if r["small_s"] else "—"
        lines.append(f"| {r['bandwidth']} | {r['codec']} | {median:.3f} | {min(r['big_s']):.3f}"
                     f" | {first[r['bandwidth']] / median:.2f}× | {sent / 1e6:.1f} | "
                     f"{f'{8 * sent / link:.3f}' if link else '—'} | {small} |")
    return lines


def main(argv=None) -> int:
    return runner.feature_main(argv, __doc__, add_args, measure, table)


if __name__ == "__main__":
    sys.exit(main())
