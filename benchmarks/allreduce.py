"""All-reduce times between emulated hosts: Open MPI's own (``--codecs mpi``, mpi4py's
``Allreduce`` under plain ``mpirun``; docs/cluster.md) or the engine's through tf_poseidon's
codecs (docs/compression.md); per codec the slowest rank's median and best time of --repeats
all-reduces of --megabytes MiB (each as --pieces all-reduces back to back) after warm-ups, the
speed-up over the first codec, the bytes each rank sends and their time at the link rate (the
floor), and the median of --small-repeats of 1 KB. --loopback: 2 ranks on one namespace's
shaped ``lo`` instead of --hosts hosts.
"""

import statistics
import sys

from benchmarks import report, runner


def measure(args, bench: runner.Bench) -> dict:
    ranks, mpi = 2 if args.loopback else args.hosts, args.codecs == ["mpi"]
    flags = {k: getattr(args, k) for k in ("codecs", "megabytes", "repeats", "small_repeats",
                                           "pieces")}
    job = runner.Job("allreduce", ranks, flags, launch="mpirun" if mpi else "launcher",
                     bind_to=args.bind_to)
    out = {"ranks": ranks, "where": "loopback" if args.loopback else f"{args.hosts} hosts",
           "megabytes": args.megabytes, "pieces": args.pieces, "rows": []}
    for bandwidth in args.bandwidth:
        with bench.hosts(ranks, bandwidth, shared_lo=args.loopback) as cluster:
            [result] = bench.repeat(cluster, {bandwidth: job})[bandwidth]
        times = [r["allreduce"] for r in result["per_rank"]]
        out["rows"] += [{"bandwidth": bandwidth, "codec": codec} | {  # the slowest rank's
            key: [max(x) for x in zip(*(t[codec][key] for t in times))]
            for key in ("big_s", "small_s")} for codec in args.codecs]
    return out


def table(results: dict) -> list[str]:
    from tf_poseidon.comm import codecs
    elements, rows, first = int(results["megabytes"] * 2**20) // 4, [], {}
    for r in results["rows"]:
        median = statistics.median(r["big_s"])
        sent = codecs.get("none" if r["codec"] == "mpi" else r["codec"]).wire_bytes(
            elements, results["ranks"])[0]
        link = report.rate_bits(None if r["bandwidth"] == "none" else r["bandwidth"])
        rows.append([r["bandwidth"], r["codec"], f"{median:.3f}", f"{min(r['big_s']):.3f}",
                     f"{first.setdefault(r['bandwidth'], median) / median:.2f}×",
                     f"{sent / 1e6:.1f}", f"{8 * sent / link:.3f}" if link else "—",
                     f"{1e3 * statistics.median(r['small_s']):.3f}" if r["small_s"] else "—"])
    pieces = results.get("pieces", 1)
    return [f"{results['where']}, {results['megabytes']:g} MiB of float32 all-reduced in "
            f"{pieces} piece(s) back to back (slowest rank: median, best) and 1 KB (median)",
            "", *report.table(
                ["link", "codec", "median (s)", "best (s)", "speed-up", "MB sent per rank",
                 "floor (s)", "1 KB (ms)"], rows)]


if __name__ == "__main__":
    sys.exit(runner.feature_main(__doc__, measure, table, bandwidth=["1gbit"], hosts=2,
                                 loopback=False, codecs=["mpi"], megabytes=64.0, repeats=5,
                                 small_repeats=500, pieces=1, bind_to="none"))
