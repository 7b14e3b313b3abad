"""MPI all-reduce times across an emulated cluster (the figures in docs/cluster.md).

::

    python -m tf_poseidon.testing.allreduce_bench --bandwidth 1gbit 10gbit none

builds a 2-host :class:`EmulatedCluster` (``--loopback``: a :class:`ShapedLoopback` with 2
ranks) per bandwidth ("none": unshaped), runs this module under ``mpirun`` on it
(``--worker``), and prints per bandwidth the time of a 64 MB float32 ``Allreduce`` (slowest
rank, median and best of ``--big-repeats``) and of a 1 KB one. Blocks for the runs; each
has a timeout (``--timeout``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from typing import Sequence

BIG_BYTES = 64 * 2**20
SMALL_BYTES = 1024


def worker(big_repeats: int, small_repeats: int) -> None:
    """One rank's part (run under mpirun): times the all-reduces, checks the sums, and rank 0
    prints one JSON line. Blocks in MPI collectives for the whole measurement."""
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    results: dict[str, object] = {"ranks": comm.size}

    def timed(n_elements: int, repeats: int) -> list[float]:
        """Per-repeat times of the slowest rank (valid on rank 0)."""
        x = np.ones(n_elements, np.float32)
        y = np.empty_like(x)
        times = np.empty(repeats)
        for i in range(repeats):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(x, y)
            times[i] = time.perf_counter() - start
        if not np.all(y == comm.size):
            raise AssertionError(f"wrong all-reduce result on rank {comm.rank}")
        slowest = np.empty_like(times)
        comm.Reduce(times, slowest, op=MPI.MAX, root=0)
        return slowest.tolist()

    timed(BIG_BYTES // 4, 1)  # warm-up: connections, buffers
    big = timed(BIG_BYTES // 4, big_repeats)
    timed(SMALL_BYTES // 4, 20)
    small = timed(SMALL_BYTES // 4, small_repeats)
    if comm.rank == 0:
        results["big_s"] = {"median": statistics.median(big), "min": min(big)}
        results["small_ms"] = {"median": 1e3 * statistics.median(small),
                               "mean": 1e3 * statistics.fmean(small)}
        print(json.dumps(results), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tf_poseidon.testing.allreduce_bench")
    parser.add_argument("--bandwidth", nargs="+", default=["1gbit", "10gbit", "none"])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--loopback", action="store_true",
                        help="2 ranks on one shaped loopback (ShapedLoopback) instead of hosts")
    parser.add_argument("--big-repeats", type=int, default=5)
    parser.add_argument("--small-repeats", type=int, default=500)
    parser.add_argument("--mpi-args", default="", help="extra mpirun arguments")
    parser.add_argument("--bind-to", default="none",
                        help="mpirun's --bind-to (Open MPI's own default binds to cores)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per bandwidth, seconds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.big_repeats, args.small_repeats)
        return 0
    from tf_poseidon.testing.emulated_cluster import EmulatedCluster, ShapedLoopback
    for bandwidth in args.bandwidth:
        shaped = None if bandwidth == "none" else bandwidth
        cluster = ShapedLoopback(shaped) if args.loopback else EmulatedCluster(args.hosts, shaped)
        with cluster:
            mpirun = cluster.mpirun_args(slots_per_host=2 if args.loopback else 1)
            mpirun[mpirun.index("--bind-to") + 1] = args.bind_to
            done = cluster.run(
                # Run as a file, not with -m, so that the ranks do not import tf_poseidon.
                [*mpirun, *shlex.split(args.mpi_args), sys.executable,
                 os.path.abspath(__file__), "--worker", "--big-repeats", str(args.big_repeats),
                 "--small-repeats", str(args.small_repeats)],
                timeout=args.timeout)
        if done.returncode != 0:
            sys.stderr.write(done.stdout + done.stderr)
            return done.returncode
        r = json.loads(done.stdout.strip().splitlines()[-1])
        where = "loopback" if args.loopback else f"{args.hosts} hosts"
        print(f"{where}, {bandwidth:>6}: 64 MB fp32 all-reduce median "
              f"{r['big_s']['median']:.3f} s (min {r['big_s']['min']:.3f}); 1 KB all-reduce "
              f"median {r['small_ms']['median']:.3f} ms (mean {r['small_ms']['mean']:.3f})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
