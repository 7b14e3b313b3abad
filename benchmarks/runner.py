"""Runs benchmark jobs: the hosts, the launch of every rank of benchmarks/worker.py, their result
files, repeats and timeouts; and the command line the per-feature benchmarks share.

Hosts (:func:`hosts`): a :class:`tf_poseidon.testing.EmulatedCluster` — one network namespace
per rank ("host"), each link shaped with tc, real multi-host ``mpirun`` over TCP; needs root —
or, with ``--no-netns`` or where namespaces cannot be built, :class:`Loopback`: the ranks on
this machine, unshaped, and no per-host wire bytes. Both are context managers whose exit kills
what they started. A job (:class:`Job`) runs on them with :func:`run`, which blocks until every
rank has exited or the job's timeout has passed, and returns what the ranks wrote.
"""

from __future__ import annotations

import argparse
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
import threading
import time
from typing import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "worker.py")
MWMS_PORT = 23456  # each emulated host has its own network namespace, so one port for all
RANK_ENV = {
    "TF_NUM_INTRAOP_THREADS": "1",      # one compute thread per rank (TF's own variable)
    "TF_POSEIDON_INTRA_THREADS": "1",   # the same for tf_poseidon's placement
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
}
UNSHAPED = ("all ranks on this machine's loopback, UNSHAPED (no bandwidth limit, no per-host "
            "wire bytes): the figures do not describe a cluster")


class Loopback:
    """EmulatedCluster's interface for ``ranks`` processes on this machine's loopback,
    unshaped. Kills the process groups it started on exit."""

    def __init__(self, ranks: int):
        self.hosts = ["localhost"] * ranks
        self._procs: list[subprocess.Popen] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        for proc in self._procs:
            _kill_group(proc)

    def mpirun_args(self, slots_per_host: int = 1) -> list[str]:
        from tf_poseidon.launcher import find_mpirun
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        return [find_mpirun(), *root, "-np", str(len(self.hosts)), "--oversubscribe",
                "--bind-to", "none"]

    def launcher_args(self, slots_per_host: int = 1) -> list[str]:
        return ["-np", str(len(self.hosts))]

    def run(self, argv: Sequence[str], *, timeout: float, env: dict | None = None,
            ) -> subprocess.CompletedProcess:
        """Runs ``argv`` in its own process group until it exits; kills the group on timeout
        (raising TimeoutExpired with the output so far) or on any exception."""
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, **(env or {})},
                                start_new_session=True)
        self._procs.append(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, stdout, stderr) from None
        except BaseException:
            _kill_group(proc)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def hosts(ranks: int, bandwidth: str | None, emulate: bool, shared_lo: bool = False):
    """Where a job of ``ranks`` ranks runs (use with ``with``; the exit tears it down): an
    EmulatedCluster of ``ranks`` hosts at ``bandwidth`` (a tc rate, None: unshaped), with
    ``shared_lo`` a ShapedLoopback (all ranks on one namespace's shaped ``lo``), or without
    ``emulate`` the unshaped :class:`Loopback`."""
    if not emulate:
        return Loopback(ranks)
    from tf_poseidon.testing import EmulatedCluster, ShapedLoopback
    return ShapedLoopback(bandwidth) if shared_lo else EmulatedCluster(ranks, bandwidth)


def emulation(no_netns: bool) -> tuple[bool, str]:
    """(emulate?, a sentence for the report): EmulatedCluster where this machine allows it."""
    if no_netns:
        return False, f"--no-netns given: {UNSHAPED}."
    from tf_poseidon.testing import available
    ok, why = available()
    if not ok:
        return False, f"emulated hosts not available ({why}): {UNSHAPED}."
    return True, ("tf_poseidon.testing.EmulatedCluster — one network namespace per rank "
                  "(\"host\", own hostname), a veth pair from each host's `eth0` to a port of a "
                  "bridge in a switch namespace, both directions of every link shaped with "
                  "`tc tbf rate <bandwidth> burst 1mb latency 50ms` (full-duplex switched "
                  "Ethernet); real multi-host `mpirun` (rsh agent into the namespaces), TCP "
                  "over `eth0`. All hosts share this machine's cores.")


def rank_env() -> dict[str, str]:
    """What every rank's environment gets on top of the driver's: one compute thread, and a
    PYTHONPATH under which the ranks import the same tf_poseidon as the driver (the checkout's
    if the driver imported that one; else the user's PYTHONPATH is left as it is)."""
    import tf_poseidon
    env = dict(RANK_ENV)
    path = os.environ.get("PYTHONPATH", "")
    origin = os.path.dirname(os.path.dirname(os.path.abspath(tf_poseidon.__file__)))
    if origin == ROOT and ROOT not in path.split(os.pathsep):
        path = os.pathsep.join(filter(None, [ROOT, path]))
    if path:
        env["PYTHONPATH"] = path
    return env


@dataclasses.dataclass
class Job:
    """``ranks`` processes of benchmarks/worker.py ``--kind kind`` with the worker flags
    ``args`` (name → value; True for a bare flag) and, for kind "poseidon", the strategy's
    keyword arguments ``options``. ``launch``: "launcher" (tfposeidon-run; the default for
    poseidon), "mpirun" (the default for more than one rank) or "process" (one process);
    ``mpi_args`` replace or extend the cluster's mpirun arguments ("--bind-to X" replaces)."""

    kind: str
    ranks: int
    args: dict = dataclasses.field(default_factory=dict)
    options: dict | None = None
    launch: str | None = None
    mpi_args: list[str] = dataclasses.field(default_factory=list)

    def name(self) -> str:
        return "-".join([self.kind, str(self.ranks), *map(str, self.args.values())])


def command(job: Job, cluster, out: str) -> list[str]:
    """The argv that runs ``job`` on ``cluster``'s first host, the ranks writing to ``out``."""
    worker = [sys.executable, WORKER, "--kind", job.kind, "--out", out]
    for key, value in job.args.items():
        values = [] if value is True else value if isinstance(value, list) else [value]
        worker += [f"--{key.replace('_', '-')}", *map(str, values)]
    emulated = not isinstance(cluster, Loopback)
    if emulated and len(cluster.hosts) > 1:
        worker += ["--nic", "eth0"]
    if job.options is not None:
        worker += ["--options", json.dumps(job.options)]
    launch = job.launch or ("launcher" if job.kind == "poseidon"
                            else "mpirun" if job.ranks > 1 else "process")
    slots = max(1, job.ranks // len(cluster.hosts))
    if launch == "process":
        return worker
    if launch == "launcher":
        return [sys.executable, "-m", "tf_poseidon.launcher", *cluster.launcher_args(slots),
                *worker]
    mpirun = cluster.mpirun_args(slots)
    extra = list(job.mpi_args)
    if "--bind-to" in extra:
        i = extra.index("--bind-to")
        mpirun[mpirun.index("--bind-to") + 1] = extra.pop(i + 1)
        extra.pop(i)
    forward = [x for var in ["PATH", *rank_env()] for x in ("-x", var)]
    if job.kind == "mwms":
        if emulated:
            peers = [f"{cluster.addresses[h]}:{MWMS_PORT}" for h in cluster.hosts]
            worker += ["--peer-hosts", ",".join(cluster.hosts)]
        else:
            peers = [f"127.0.0.1:{free_port()}" for _ in range(job.ranks)]
        worker += ["--peers", ",".join(peers)]
    return [*mpirun, *extra, *forward, *worker]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(job: Job, cluster, timeout: float, logs: str | None = None, say=None) -> dict:
    """Runs ``job`` on ``cluster`` to its end or its timeout (blocking) and returns
    ``{"status": "ok" | "not available" | "failed" | "timed out", "message", "per_rank": the
    ranks' result dicts in rank order, "wall_s", "log"}``. Each job gets its own directory
    under ``logs`` (its log, the ranks' files). ``say`` shows rank 0's progress lines while
    the job runs. KeyboardInterrupt passes through (the cluster's exit ends the job)."""
    out = tempfile.mkdtemp(prefix=job.name().replace("/", "_")[:80] + "-", dir=logs)
    argv = command(job, cluster, out)
    outcome: dict = {}

    def target():
        try:
            outcome["done"] = cluster.run(argv, timeout=timeout, env=rank_env())
        except BaseException as e:  # reported by the calling thread
            outcome["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    shown = 0
    while thread.is_alive():
        thread.join(1.0)
        shown = _show_progress(os.path.join(out, "progress"), shown, say)
    _show_progress(os.path.join(out, "progress"), shown, say)
    done, error = outcome.get("done"), outcome.get("error")
    timed_out = isinstance(error, subprocess.TimeoutExpired)
    if error is not None and not timed_out:
        raise error
    source = done or error
    log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                  for x in (source.stdout, source.stderr))
    log_path = os.path.join(out, "log")
    with open(log_path, "w") as f:
        f.write(shlex.join(argv) + "\n\n" + log)
    files = [os.path.join(out, f"rank{r}.json") for r in range(job.ranks)]
    per_rank = [json.load(open(p)) for p in files if os.path.exists(p)]
    result = {"status": "ok", "message": "", "per_rank": per_rank,
              "wall_s": time.monotonic() - start, "log": log_path}
    unavailable = [r["message"] for r in per_rank if r["status"] == "not available"]
    if timed_out:
        lines = _lines(os.path.join(out, "progress")) or ["none (did not start training)"]
        result.update(status="timed out", message=f"no result within {timeout:g} s; last "
                                                  f"progress: {lines[-1]}")
    elif unavailable:
        result.update(status="not available", message=unavailable[0])
    elif done.returncode != 0 or len(per_rank) < job.ranks:
        result.update(status="failed", message=f"exit {done.returncode}, {len(per_rank)}/"
                                               f"{job.ranks} ranks reported; {error_line(log)}")
    return result


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def _show_progress(path: str, shown: int, say) -> int:
    lines = _lines(path)
    for line in lines[shown:] if say else []:
        say(f"      {line}")
    return len(lines)


_NOISE = ("WARNING: All log messages before absl::InitializeLog()", "oneDNN custom operations",
          "cpu_feature_guard", "To enable the following instructions")


def error_line(log: str) -> str:
    """The most telling line of a failed job's output: the first Python exception line (the
    rank that failed first prints it first), else the last line mentioning an error, else the
    last line that is not TensorFlow's start-up chatter."""
    lines = [line.strip() for line in log.splitlines()
             if line.strip() and not any(n in line for n in _NOISE)]
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b.*:", line)]
    errors = [line for line in lines if re.search(r"\b\w*(Error|Exception)\b", line)
              or "Killed" in line or "ABORT" in line.upper()]
    found = raised[:1] or errors[-1:] or lines[-1:]
    return found[0][:400] if found else "no output"


def aggregate(per_rank: list[dict], batch: int) -> dict:
    """The figures of a training job from its ranks' results: ``samples_per_s`` of all ranks
    together (all timed samples over the slowest rank's timed wall time: a rank running ahead,
    as SSP and EASGD allow, does not count for more than the job finishes), ``span_samples_per_s``
    (the same samples over the latest end minus the earliest start: one machine's clock),
    the slowest rank's step time, per-host wire bytes per timed step, and tf_poseidon's own
    bytes per step and hidden fraction (the busiest rank's bytes, the ranks' mean fraction)."""
    per_rank = sorted(per_rank, key=lambda r: r["rank"])
    slowest = max(per_rank, key=lambda r: r["window_s"])
    samples = sum(batch * r["steps"] for r in per_rank)
    per_step = lambda key: [r[key] / r["steps"] if key in r else None for r in per_rank]
    out = {
        "samples_per_s": samples / slowest["window_s"],
        "span_samples_per_s": samples / (max(r["end_s"] for r in per_rank)
                                         - min(r["start_s"] for r in per_rank)),
        "step_s": slowest["window_s"] / slowest["steps"],
        "step_median_s": statistics.median_low(slowest["step_times_s"]),
        "step_min_s": min(t for r in per_rank for t in r["step_times_s"]),
        "steps": per_rank[0]["steps"],
        "first_step_s": max(r["first_step_s"] for r in per_rank),
        "tx_bytes_per_step": per_step("tx_bytes"), "rx_bytes_per_step": per_step("rx_bytes"),
        "windows_s": [r["window_s"] for r in per_rank],
        "hosts": [r["host"] for r in per_rank],
        "affinity_cpus": [r["affinity_cpus"] for r in per_rank],
        "loadavg": max(r["loadavg"] for r in per_rank),
    }
    stats = [r["poseidon_stats"] for r in per_rank if r.get("poseidon_stats")]
    sent = [s["bytes_sent"] for s in stats if s.get("bytes_sent") is not None]
    hidden = [s["hidden_fraction"] for s in stats if s.get("hidden_fraction") is not None]
    if stats:
        out["engine_bytes_per_step"] = max(sent) if sent else None
        out["hidden_fraction"] = statistics.fmean(hidden) if hidden else None
    return out


class Bench:
    """What a per-feature benchmark measures with: where its ranks run, the per-job timeout,
    the logs directory, and a ``say`` for progress. Its methods block until their jobs end."""

    def __init__(self, emulate: bool, timeout: float, logs: str | None, say=print):
        self.emulate, self.timeout, self.logs, self.say = emulate, timeout, logs, say

    def hosts(self, ranks: int, bandwidth: str | None = None, **kwargs):
        return hosts(ranks, bandwidth, self.emulate, **kwargs)

    def measure(self, cluster, job: Job) -> dict:
        """Runs ``job``; its result (:func:`run`) with the :func:`aggregate` figures of a
        training job. Raises RuntimeError, naming the log, if the job did not succeed."""
        result = run(job, cluster, self.timeout, self.logs)
        if result["status"] != "ok":
            raise RuntimeError(f"{job.name()}: {result['status']}: {result['message']} "
                               f"(log: {result['log']})")
        if "steps" in result["per_rank"][0]:
            result.update(aggregate(result["per_rank"], job.args.get("batch", 32)))
        return result

    def repeat(self, cluster, jobs: dict[str, Job], repeats: int) -> dict[str, list[dict]]:
        """Every job ``repeats`` times, interleaved (A, B, A, B, ...), so that a drift of the
        machine's speed hits all alike; the results per job name."""
        runs: dict[str, list[dict]] = {name: [] for name in jobs}
        for _ in range(repeats):
            for name, job in jobs.items():
                r = self.measure(cluster, job)
                runs[name].append(r)
                step = f", {r['step_s']:.3f} s/step" if "step_s" in r else ""
                self.say(f"{name}: {r['wall_s']:.0f} s{step}, load {os.getloadavg()[0]:.1f}")
        return runs


def feature_main(argv: Sequence[str] | None, doc: str, add_args: Callable, measure: Callable,
                 table: Callable, emulated: bool = True) -> int:
    """The command line of a per-feature benchmark ``python -m benchmarks.NAME`` (``doc``: its
    module docstring): common options, ``measure(args, bench) -> results`` (JSON-able), saved
    with ``--json``, and ``table(results) -> lines`` printed; ``--from-json`` prints the table
    of saved results again without measuring. Not ``emulated``: the ranks run on this
    machine's loopback only."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], allow_abbrev=False)
    if emulated:
        p.add_argument("--no-netns", action="store_true",
                       help="no emulated hosts: all ranks unshaped on this machine's loopback")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job (900)")
    p.add_argument("--logs", help="directory for the jobs' logs (default: a new one in /tmp)")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--from-json", help="print the table of an earlier --json file")
    add_args(p)
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        emulate, where = emulation(args.no_netns) if emulated else (False, "this machine")
        logs = tempfile.mkdtemp(prefix="tfp-bench-", dir=args.logs)
        print(f"Hosts: {where}\nLogs: {logs}\nLoad average at start: "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        results = measure(args, Bench(emulate, args.timeout, logs,
                                      lambda text: print(text, flush=True)))
        results["load_at_end"] = os.getloadavg()[0]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print("\n" + "\n".join(table(results)))
    return 0
