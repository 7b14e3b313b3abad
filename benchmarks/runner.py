"""Runs benchmark jobs: every rank of benchmarks/worker.py on emulated hosts
(tf_poseidon.testing.EmulatedCluster: a network namespace per host, links shaped with tc, real
multi-host ``mpirun``; needs root) or unshaped on this machine (:class:`Loopback`), their result
files, repeats and timeouts; and the command line of the per-feature benchmarks.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MWMS_PORT = 23456  # each emulated host has its own network namespace, so one port for all
RANK_ENV = {"TF_NUM_INTRAOP_THREADS": "1",  # one compute thread per rank (TF's own variable)
            "TF_POSEIDON_INTRA_THREADS": "1",  # the same for tf_poseidon's placement
            "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}


class Loopback:
    """EmulatedCluster's interface for ``ranks`` unshaped processes on this machine."""

    def __init__(self, ranks: int):
        self.hosts = ["localhost"] * ranks

    def mpirun_args(self, slots_per_host: int = 1) -> list[str]:
        from tf_poseidon.launcher import find_mpirun
        return [find_mpirun(), *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
                "-np", str(len(self.hosts)), "--oversubscribe", "--bind-to", "none"]

    def launcher_args(self, slots_per_host: int = 1) -> list[str]:
        return ["-np", str(len(self.hosts))]

    def run(self, argv: list[str], *, timeout: float, env: dict) -> subprocess.CompletedProcess:
        """As EmulatedCluster.run: on timeout (TimeoutExpired, with the output) or an exception
        such as KeyboardInterrupt, everything ``argv`` started is killed first."""
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **env}, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException as e:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            if isinstance(e, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
            raise
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def emulation(no_netns: bool) -> tuple[bool, str]:
    """(emulate?, what the hosts are, for the report): EmulatedCluster where possible."""
    from tf_poseidon.testing import available
    ok, why = (False, "--no-netns given") if no_netns else available()
    return ok, ("tf_poseidon.testing.EmulatedCluster (docs/cluster.md): one network namespace "
                "per rank, both directions of every link shaped with `tc tbf rate <bandwidth> "
                "burst 1mb latency 50ms`, real multi-host `mpirun`, TCP over `eth0`; all hosts "
                "share this machine's cores." if ok else
                f"{why}: all ranks on this machine's loopback, UNSHAPED (no bandwidth limit, no "
                "per-host wire bytes): the figures do not describe a cluster.")


def rank_env() -> dict[str, str]:
    """RANK_ENV, and a PYTHONPATH under which the ranks import the driver's tf_poseidon (the
    checkout's if the driver imported that one; else the user's PYTHONPATH as it is)."""
    import tf_poseidon
    path = os.environ.get("PYTHONPATH", "")
    if os.path.dirname(os.path.dirname(os.path.abspath(tf_poseidon.__file__))) == ROOT and \
            ROOT not in path.split(os.pathsep):
        path = os.pathsep.join(filter(None, [ROOT, path]))
    return RANK_ENV | ({"PYTHONPATH": path} if path else {})


@dataclasses.dataclass
class Job:
    """``ranks`` processes of benchmarks/worker.py ``--kind kind`` with the worker flags
    ``args`` (name → value, a list for several, True for a bare flag) and, for "poseidon",
    the strategy's keyword arguments ``options``. ``launch``: "launcher" (tfposeidon-run; the
    default for poseidon), "mpirun" (the default for several ranks) or "process";
    ``bind_to`` replaces mpirun's ``--bind-to none``."""

    kind: str
    ranks: int
    args: dict = dataclasses.field(default_factory=dict)
    options: dict | None = None
    launch: str | None = None
    bind_to: str = "none"


def command(job: Job, cluster, out: str) -> list[str]:
    """The argv that runs ``job`` on ``cluster``'s first host, the ranks writing into ``out``."""
    worker = [sys.executable, os.path.join(ROOT, "benchmarks", "worker.py"), "--kind", job.kind,
              "--out", out]
    for key, value in job.args.items():
        values = [] if value is True else value if isinstance(value, list) else [value]
        worker += [f"--{key.replace('_', '-')}", *map(str, values)]
    hosts = cluster.hosts if not isinstance(cluster, Loopback) and len(cluster.hosts) > 1 else []
    worker += ["--nic", "eth0"] if hosts else []
    worker += ["--options", json.dumps(job.options)] if job.options is not None else []
    launch = job.launch or ("launcher" if job.kind == "poseidon" else
                            "mpirun" if job.ranks > 1 else "process")
    slots = max(1, job.ranks // len(cluster.hosts))
    if launch != "mpirun":
        return worker if launch == "process" else [
            sys.executable, "-m", "tf_poseidon.launcher", *cluster.launcher_args(slots), *worker]
    mpirun = cluster.mpirun_args(slots)
    mpirun[mpirun.index("--bind-to") + 1] = job.bind_to
    if job.kind == "mwms":  # host:port of every worker, in rank order (mpirun's placement)
        worker += ["--peers", ",".join(f"{cluster.addresses[h]}:{MWMS_PORT}" for h in hosts)
                   or ",".join(f"127.0.0.1:{free_port()}" for _ in range(job.ranks)),
                   "--peer-hosts", ",".join(hosts)]
    return [*mpirun, *[x for var in ["PATH", *rank_env()] for x in ("-x", var)], *worker]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def error_line(log: str) -> str:
    """A failed job's most telling output line: the first Python exception line (the rank
    that failed first prints it first), else the last line mentioning an error or a kill,
    else the last line; TensorFlow's start-up chatter is skipped."""
    lines = [line.strip() for line in log.splitlines() if line.strip() and not re.search(
        "absl::InitializeLog|oneDNN custom operations|cpu_feature_guard|To enable the", line)]
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b.*:", line)]
    errors = [line for line in lines if re.search(r"\b\w*(Error|Exception)\b|Killed|ABORT", line)]
    return (raised[:1] or errors[-1:] or lines[-1:] or ["no output"])[0][:400]


def aggregate(per_rank: list[dict]) -> dict:
    """A training job's figures from its ranks' results: ``samples_per_s`` (all ranks' timed
    samples over the slowest rank's window: a rank running ahead, as SSP and EASGD allow,
    counts for no more than the job finishes), ``span_samples_per_s`` (the same samples from
    the earliest start to the latest end), ``step_s`` (the slowest rank's window over its
    steps), ``step_median_s`` (the largest of the ranks' median steps), each host's
    ``tx_bytes_per_step`` (None: no counter), ``peak_rss_bytes`` (the largest rank's),
    rank 0's step ``profile`` (if profiled), and tf_poseidon's ``engine_bytes_per_step`` (the
    busiest rank's) and ``hidden_fraction`` of communication (the ranks' mean)."""
    per_rank = sorted(per_rank, key=lambda r: r["rank"])
    slowest = max(per_rank, key=lambda r: r["window_s"])
    samples = sum(r["batch"] * r["steps"] for r in per_rank)
    stats = [r["poseidon_stats"] for r in per_rank if r.get("poseidon_stats")]
    hidden = [s["hidden_fraction"] for s in stats if s.get("hidden_fraction") is not None]
    return {"samples_per_s": samples / slowest["window_s"],
            "span_samples_per_s": samples / (max(r["end_s"] for r in per_rank)
                                             - min(r["start_s"] for r in per_rank)),
            "step_s": slowest["window_s"] / slowest["steps"],
            "step_median_s": max(statistics.median(r["step_times_s"]) for r in per_rank),
            "steps": per_rank[0]["steps"], "hosts": [r["host"] for r in per_rank],
            "loadavg": max(r["loadavg"] for r in per_rank),
            "tx_bytes_per_step": [r["tx_bytes"] / r["steps"] if "tx_bytes" in r else None
                                  for r in per_rank],
            "peak_rss_bytes": max(r.get("peak_rss_bytes", 0) for r in per_rank) or None,
            **({"profile": per_rank[0]["profile"]} if "profile" in per_rank[0] else {}),
            **({"engine_bytes_per_step": max((s["bytes_sent"] for s in stats
                                              if s.get("bytes_sent") is not None), default=None),
                "hidden_fraction": statistics.fmean(hidden) if hidden else None}
               if stats else {})}


class Bench:
    """How a benchmark runs its jobs: on emulated hosts if ``emulate`` (else unshaped on this
    machine), each for at most ``timeout`` seconds, its log and rank files in a new directory
    of a ``tfp-bench-*`` directory made under ``logs`` (None: the system's temporary one)."""

    def __init__(self, emulate: bool, timeout: float, logs: str | None = None):
        if logs:
            os.makedirs(logs, exist_ok=True)
        self.emulate, self.timeout = emulate, timeout
        self.logs = tempfile.mkdtemp(prefix="tfp-bench-", dir=logs)

    def hosts(self, ranks: int, bandwidth: str | None = None, shared_lo: bool = False):
        """A context manager of where a job of ``ranks`` ranks runs (its exit kills what runs
        there): ``ranks`` emulated hosts at ``bandwidth`` (a tc rate; None or "none":
        unshaped), or with ``shared_lo`` one namespace's shaped ``lo`` (ShapedLoopback);
        :class:`Loopback` for one rank or when not emulating."""
        if not self.emulate or ranks == 1:
            return contextlib.nullcontext(Loopback(ranks))
        from tf_poseidon.testing import EmulatedCluster, ShapedLoopback
        bandwidth = None if bandwidth == "none" else bandwidth
        return ShapedLoopback(bandwidth) if shared_lo else EmulatedCluster(ranks, bandwidth)

    def run(self, cluster, job: Job) -> dict:
        """Runs ``job`` on ``cluster`` to its end or its timeout (blocking); returns
        ``{"status": "ok" | "not available" | "failed" | "timed out", "message", "per_rank":
        the ranks' result dicts in rank order, "wall_s", "log"}`` and, for a training job that
        succeeded, the :func:`aggregate` figures. KeyboardInterrupt passes through."""
        out = tempfile.mkdtemp(prefix=f"{job.kind}-{job.args.get('model', '')}-", dir=self.logs)
        argv, start, log = command(job, cluster, out), time.monotonic(), os.path.join(out, "log")
        try:
            done = cluster.run(argv, timeout=self.timeout, env=rank_env())
        except subprocess.TimeoutExpired as e:
            done = e
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                         for x in (done.stdout, done.stderr))
        with open(log, "w") as f:
            f.write(shlex.join(argv) + "\n\n" + output)
        files = [os.path.join(out, f"rank{r}.json") for r in range(job.ranks)]
        per_rank = [json.load(open(p)) for p in files if os.path.exists(p)]
        unavailable = [r["message"] for r in per_rank if r["status"] == "not available"]
        if isinstance(done, subprocess.TimeoutExpired):
            progress = os.path.join(out, "progress")
            last = open(progress).read().splitlines()[-1:] if os.path.exists(progress) else []
            status, message = "timed out", f"no result within {self.timeout:g} s; last " \
                f"progress: {(last or ['none (did not start training)'])[0]}"
        elif unavailable:
            status, message = "not available", unavailable[0]
        elif done.returncode == 0 and len(per_rank) == job.ranks:
            status, message = "ok", ""
        else:
            status, message = "failed", f"exit {done.returncode}, {len(per_rank)}/{job.ranks} " \
                f"ranks reported; {error_line(output)}"
        figures = aggregate(per_rank) if status == "ok" and "steps" in per_rank[0] else {}
        return {"status": status, "message": message, "per_rank": per_rank, **figures,
                "wall_s": time.monotonic() - start, "log": log}

    def repeat(self, cluster, jobs: dict[str, Job], repeats: int = 1) -> dict[str, list[dict]]:
        """Every job ``repeats`` times, interleaved (A, B, A, B, ...) so that a drift of the
        machine's speed hits all alike (blocking): per job name, its results (:meth:`run`).
        Raises RuntimeError, naming the log, for a job that did not succeed."""
        runs: dict[str, list[dict]] = {name: [] for name in jobs}
        for _ in range(repeats):
            for name, job in jobs.items():
                r = self.run(cluster, job)
                if r["status"] != "ok":
                    raise RuntimeError(f"{name}: {r['status']}: {r['message']} ({r['log']})")
                runs[name].append(r)
                print(f"{name}: {r['wall_s']:.0f} s" + (f", {r['step_s']:.3f} s/step" if
                      "step_s" in r else "") + f", load {os.getloadavg()[0]:.1f}", flush=True)
        return runs


def feature_main(doc: str, measure, table, emulated: bool = True, **defaults) -> int:
    """The command line of a per-feature benchmark, blocking: ``doc`` is the help's text;
    ``--timeout`` (seconds per job), ``--json FILE`` (keeps the figures), ``--from-json FILE``
    (prints their table, measuring nothing), ``--no-netns`` if ``emulated`` (else the ranks
    always run on this machine), and an option per ``defaults`` entry (a list: one or more
    values; False: a bare flag). Prints ``table(measure(args, bench))``."""
    p = argparse.ArgumentParser(description=doc, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job; 900")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--from-json", help="print the table of an earlier --json file")
    for name, value in (defaults | ({"no_netns": False} if emulated else {})).items():
        many, flag = isinstance(value, list), f"--{name.replace('_', '-')}"
        if value is False:
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=type(value[0] if many else value), default=value,
                           nargs="+" if many else None,
                           help=f"default: {' '.join(map(str, value)) if many else value}")
    args = p.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        emulate, where = emulation(args.no_netns) if emulated else (False, "this machine")
        if not emulate and hasattr(args, "bandwidth"):  # what the tables say of the links
            args.bandwidth = ["none"] if isinstance(args.bandwidth, list) else "none"
        bench = Bench(emulate, args.timeout)
        print(f"Hosts: {where}\nLogs: {bench.logs}\nLoad average: {os.getloadavg()[0]:.1f}",
              flush=True)
        results = measure(args, bench)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print("\n" + "\n".join(table(results)))
    return 0


def model_args(args) -> dict:
    """The worker flags of a per-feature benchmark's model options (an MLP by default)."""
    keys = ("model", "width", "layers", "batch", "warmup", "steps")
    return {"model": "mlp"} | {k: getattr(args, k) for k in keys if hasattr(args, k)}


def versus_main(doc: str, column: str, variants: dict[str, tuple[dict, dict]],
                **defaults) -> int:
    """:func:`feature_main` of a protocol against its baseline (benchmarks/sfb.py, sparse.py):
    for each ``--ranks``, on that many hosts at ``--bandwidth``, a tf_poseidon job per variant
    (name → (worker flags, strategy options); the baseline first) and, on the first cluster,
    one process alone, each ``--repeats`` times interleaved; :func:`versus_table` prints."""
    def measure(args, bench: Bench) -> dict:
        out = {"bandwidth": args.bandwidth, "batch": args.batch, "variants": list(variants),
               "runs": []}
        for ranks in args.ranks:
            jobs = {(name, ranks): Job("poseidon", ranks, model_args(args) | flags, options)
                    for name, (flags, options) in variants.items()}
            if ranks == args.ranks[0]:
                jobs = {("-", 1): Job("single", 1, model_args(args))} | jobs
            with bench.hosts(ranks, args.bandwidth) as cluster:
                runs = bench.repeat(cluster, {f"P={p} {v}": job for (v, p), job in jobs.items()},
                                    args.repeats)
            out["runs"] += [{  # the slowest rank's median step; rank 0's bytes and plan
                "ranks": p, "variant": variant, "step_time_s": r["step_median_s"],
                "samples_per_s": args.batch * p / r["step_median_s"],
                "eth0_tx_bytes_per_step": r["tx_bytes_per_step"][0] if p > 1 else None,
                "stats_bytes_sent_per_step": r["per_rank"][0].get("poseidon_stats", {}).get(
                    "bytes_sent"), "plan": r["per_rank"][0].get("plan", "")}
                for (variant, p), results in zip(jobs, runs.values()) for r in results]
        return out
    return feature_main(doc, measure, lambda results: versus_table(results, column), **defaults)


def versus_table(results: dict, column: str) -> list[str]:
    """:func:`versus_main`'s table: per world size and variant the run with the median step
    time, its bytes and step time against the baseline's, and the plan of the second variant."""
    base, new = results["variants"][:2]
    runs: dict = {}
    for r in results["runs"]:
        runs.setdefault((r["ranks"] == 1, r["ranks"], r["variant"]), []).append(r)
    chosen = {key: next(r for r in group if r["step_time_s"] == statistics.median_low(
        x["step_time_s"] for x in group)) for key, group in runs.items()}
    mb = lambda value: "-" if value is None else f"{value / 1e6:.2f}"  # noqa: E731
    rows = []
    for (alone, ranks, variant), r in sorted(chosen.items()):
        baseline, ratio, speedup = chosen.get((False, ranks, base)), "-", "-"
        if variant == new and baseline:
            ratio = f"{r['stats_bytes_sent_per_step'] / baseline['stats_bytes_sent_per_step']:.2%}"
            if r["eth0_tx_bytes_per_step"] and baseline["eth0_tx_bytes_per_step"]:
                eth0 = r["eth0_tx_bytes_per_step"] / baseline["eth0_tx_bytes_per_step"]
                ratio += f" (eth0 {eth0:.2%})"
            speedup = f"{baseline['step_time_s'] / r['step_time_s']:.2f}×"
        rows.append(["1 (alone)" if alone else ranks, variant, f"{r['step_time_s']:.3f}",
                     f"{r['samples_per_s']:.1f}", mb(r["stats_bytes_sent_per_step"]),
                     mb(r["eth0_tx_bytes_per_step"]), ratio, speedup,
                     ", ".join(f"{x['step_time_s']:.2f}" for x in runs[(alone, ranks, variant)])])
    return [f"{results['bandwidth']} per host, batch {results['batch']} per rank, one compute "
            "thread per rank", "", *report.table(
                ["P", column, "step (s)", "samples/s", "MB/step/rank (stats)",
                 "MB/step/rank (eth0 tx)", f"bytes {new}/{base}", f"speed-up {new}/{base}",
                 "step of each run (s)"], rows)] + [
        f"\nThe plan of {column}={new} at P={r['ranks']}:\n{r['plan']}"
        for (_, _, variant), r in sorted(chosen.items()) if variant == new and r["plan"]]
