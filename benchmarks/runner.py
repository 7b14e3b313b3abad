"""Runs benchmark jobs: the hosts, the launch of every rank of benchmarks/worker.py, the ranks'
result files, repeats and timeouts; and the command line the per-feature benchmarks share.

Hosts (:func:`hosts`): a tf_poseidon.testing.EmulatedCluster (one network namespace per rank,
links shaped with tc, real multi-host ``mpirun`` over TCP; needs root) or, with ``--no-netns``
or where namespaces cannot be built, :class:`Loopback`: the ranks on this machine, unshaped,
without per-host wire bytes. Both are context managers whose exit kills what they started.
"""

from __future__ import annotations

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
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MWMS_PORT = 23456  # each emulated host has its own network namespace, so one port for all
RANK_ENV = {"TF_NUM_INTRAOP_THREADS": "1",  # one compute thread per rank (TF's own variable)
            "TF_POSEIDON_INTRA_THREADS": "1",  # the same for tf_poseidon's placement
            "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
UNSHAPED = ("all ranks on this machine's loopback, UNSHAPED (no bandwidth limit, no per-host "
            "wire bytes): the figures do not describe a cluster")


class Loopback:
    """EmulatedCluster's interface for ``ranks`` unshaped processes on this machine."""

    def __init__(self, ranks: int):
        self.hosts, self._procs = ["localhost"] * ranks, []

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def mpirun_args(self, slots_per_host: int = 1) -> list[str]:
        from tf_poseidon.launcher import find_mpirun
        return [find_mpirun(), *(["--allow-run-as-root"] if os.geteuid() == 0 else []),
                "-np", str(len(self.hosts)), "--oversubscribe", "--bind-to", "none"]

    def launcher_args(self, slots_per_host: int = 1) -> list[str]:
        return ["-np", str(len(self.hosts))]

    def run(self, argv: list[str], *, timeout: float, env: dict) -> subprocess.CompletedProcess:
        """Runs ``argv`` (its own process group) to its exit; on timeout kills the group and
        raises TimeoutExpired with the output so far."""
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **env}, start_new_session=True)
        self._procs.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.__exit__()
            raise subprocess.TimeoutExpired(argv, timeout, *proc.communicate()) from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def hosts(ranks: int, bandwidth: str | None, emulate: bool, shared_lo: bool = False):
    """Where a job of ``ranks`` ranks runs (use with ``with``): ``ranks`` emulated hosts at
    ``bandwidth`` (a tc rate; None: unshaped), with ``shared_lo`` one namespace's shaped ``lo``
    (ShapedLoopback), or without ``emulate`` the unshaped :class:`Loopback`."""
    if not emulate:
        return Loopback(ranks)
    from tf_poseidon.testing import EmulatedCluster, ShapedLoopback
    return ShapedLoopback(bandwidth) if shared_lo else EmulatedCluster(ranks, bandwidth)


def emulation(no_netns: bool) -> tuple[bool, str]:
    """(emulate?, a sentence for the report): EmulatedCluster where this machine allows it."""
    from tf_poseidon.testing import available
    ok, why = (False, "--no-netns given") if no_netns else available()
    if not ok:
        return False, f"{why}: {UNSHAPED}."
    return True, ("tf_poseidon.testing.EmulatedCluster — one network namespace per rank "
                  "(\"host\", own hostname), a veth pair from each host's `eth0` to a port of a "
                  "bridge in a switch namespace, both directions of every link shaped with "
                  "`tc tbf rate <bandwidth> burst 1mb latency 50ms` (full-duplex switched "
                  "Ethernet); real multi-host `mpirun` (rsh agent into the namespaces), TCP "
                  "over `eth0`. All hosts share this machine's cores.")


def rank_env() -> dict[str, str]:
    """What every rank's environment gets on top of the driver's: one compute thread, and a
    PYTHONPATH under which the ranks import the driver's tf_poseidon (the checkout's if the
    driver imported that one; else the user's PYTHONPATH is left as it is)."""
    import tf_poseidon
    env, path = dict(RANK_ENV), os.environ.get("PYTHONPATH", "")
    origin = os.path.dirname(os.path.dirname(os.path.abspath(tf_poseidon.__file__)))
    if origin == ROOT and ROOT not in path.split(os.pathsep):
        path = os.pathsep.join(filter(None, [ROOT, path]))
    return env | ({"PYTHONPATH": path} if path else {})


@dataclasses.dataclass
class Job:
    """``ranks`` processes of benchmarks/worker.py ``--kind kind`` with the worker flags
    ``args`` (name → value, a list for several, True for a bare flag) and, for "poseidon",
    the strategy's keyword arguments ``options``. ``launch``: "launcher" (tfposeidon-run; the
    default for poseidon), "mpirun" (the default for more than one rank) or "process";
    ``mpi_args`` extend mpirun's arguments ("--bind-to X" replaces the cluster's)."""

    kind: str
    ranks: int
    args: dict = dataclasses.field(default_factory=dict)
    options: dict | None = None
    launch: str | None = None
    mpi_args: list[str] = dataclasses.field(default_factory=list)


def command(job: Job, cluster, out: str) -> list[str]:
    """The argv that runs ``job`` on ``cluster``'s first host, the ranks writing into ``out``."""
    worker = [sys.executable, os.path.join(ROOT, "benchmarks", "worker.py"), "--kind", job.kind,
              "--out", out]
    for key, value in job.args.items():
        values = [] if value is True else value if isinstance(value, list) else [value]
        worker += [f"--{key.replace('_', '-')}", *map(str, values)]
    emulated = not isinstance(cluster, Loopback) and len(cluster.hosts) > 1
    worker += ["--nic", "eth0"] if emulated else []
    worker += ["--options", json.dumps(job.options)] if job.options is not None else []
    launch = job.launch or ("launcher" if job.kind == "poseidon" else
                            "mpirun" if job.ranks > 1 else "process")
    slots = max(1, job.ranks // len(cluster.hosts))
    if launch != "mpirun":
        return worker if launch == "process" else [
            sys.executable, "-m", "tf_poseidon.launcher", *cluster.launcher_args(slots), *worker]
    mpirun, extra = cluster.mpirun_args(slots), list(job.mpi_args)
    if "--bind-to" in extra:
        i = extra.index("--bind-to")
        mpirun[mpirun.index("--bind-to") + 1] = extra[i + 1]
        del extra[i:i + 2]
    if job.kind == "mwms":  # host:port of every worker, in rank order (mpirun's placement)
        ports = [MWMS_PORT] * job.ranks if emulated else [free_port() for _ in cluster.hosts]
        addresses = [cluster.addresses[h] for h in cluster.hosts] if emulated else \
            ["127.0.0.1"] * job.ranks
        worker += ["--peers", ",".join(f"{a}:{p}" for a, p in zip(addresses, ports))]
        worker += ["--peer-hosts", ",".join(cluster.hosts)] if emulated else []
    forward = [x for var in ["PATH", *rank_env()] for x in ("-x", var)]
    return [*mpirun, *extra, *forward, *worker]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(job: Job, cluster, timeout: float, logs: str | None = None, say=None) -> dict:
    """Runs ``job`` on ``cluster`` to its end or its timeout (blocking); returns ``{"status":
    "ok" | "not available" | "failed" | "timed out", "message", "per_rank": the ranks' result
    dicts in rank order, "wall_s", "log"}``. The job's log and the ranks' files go into a new
    directory under ``logs``; ``say`` shows rank 0's progress lines while it runs.
    KeyboardInterrupt passes through (the cluster's exit ends the job)."""
    out = tempfile.mkdtemp(prefix=f"{job.kind}-{job.args.get('model', '')}-", dir=logs)
    argv, outcome, shown, alive, start = command(job, cluster, out), {}, 0, True, time.monotonic()

    def target():
        try:
            outcome["done"] = cluster.run(argv, timeout=timeout, env=rank_env())
        except BaseException as e:  # reported by the calling thread
            outcome["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    while alive:
        thread.join(1.0)
        alive = thread.is_alive()  # before reading the progress: no last line is missed
        progress = _lines(os.path.join(out, "progress"))
        for line in progress[shown:] if say else []:
            say(f"      {line}")
        shown = len(progress)
    done, error = outcome.get("done"), outcome.get("error")
    if error is not None and not isinstance(error, subprocess.TimeoutExpired):
        raise error
    log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                  for x in ((done or error).stdout, (done or error).stderr))
    with open(os.path.join(out, "log"), "w") as f:
        f.write(shlex.join(argv) + "\n\n" + log)
    files = [os.path.join(out, f"rank{r}.json") for r in range(job.ranks)]
    per_rank = [json.load(open(p)) for p in files if os.path.exists(p)]
    result = {"status": "ok", "message": "", "per_rank": per_rank,
              "wall_s": time.monotonic() - start, "log": os.path.join(out, "log")}
    unavailable = [r["message"] for r in per_rank if r["status"] == "not available"]
    if error is not None:
        last = (_lines(os.path.join(out, "progress")) or ["none (did not start training)"])[-1]
        result.update(status="timed out",
                      message=f"no result within {timeout:g} s; last progress: {last}")
    elif unavailable:
        result.update(status="not available", message=unavailable[0])
    elif done.returncode != 0 or len(per_rank) < job.ranks:
        result.update(status="failed", message=f"exit {done.returncode}, {len(per_rank)}/"
                                               f"{job.ranks} ranks reported; {error_line(log)}")
    return result


def _lines(path: str) -> list[str]:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read().splitlines()
    return []


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
    """A training job's figures from its ranks' results: ``samples_per_s`` of all ranks (all
    timed samples over the slowest rank's timed window: a rank running ahead, as SSP and EASGD
    allow, counts for no more than the job finishes), ``span_samples_per_s`` (the same over the
    latest end minus the earliest start; one machine's monotonic clock), the slowest rank's
    step time, per-host wire bytes per timed step, and tf_poseidon's own bytes per step (the
    busiest rank's) and hidden fraction (the ranks' mean)."""
    per_rank = sorted(per_rank, key=lambda r: r["rank"])
    slowest = max(per_rank, key=lambda r: r["window_s"])
    samples = sum(batch * r["steps"] for r in per_rank)
    stats = [r["poseidon_stats"] for r in per_rank if r.get("poseidon_stats")]
    sent = [s["bytes_sent"] for s in stats if s.get("bytes_sent") is not None]
    hidden = [s["hidden_fraction"] for s in stats if s.get("hidden_fraction") is not None]
    return {
        "samples_per_s": samples / slowest["window_s"],
        "span_samples_per_s": samples / (max(r["end_s"] for r in per_rank)
                                         - min(r["start_s"] for r in per_rank)),
        "step_s": slowest["window_s"] / slowest["steps"],
        "step_median_s": statistics.median_low(slowest["step_times_s"]),
        "steps": per_rank[0]["steps"],
        "first_step_s": max(r["first_step_s"] for r in per_rank),
        **{f"{d}_bytes_per_step": [r[f"{d}_bytes"] / r["steps"] if f"{d}_bytes" in r else None
                                   for r in per_rank] for d in ("tx", "rx")},
        **{key: [r[k] for r in per_rank] for key, k in (
            ("windows_s", "window_s"), ("hosts", "host"), ("affinity_cpus", "affinity_cpus"))},
        "loadavg": max(r["loadavg"] for r in per_rank),
        **({"engine_bytes_per_step": max(sent, default=None),
            "hidden_fraction": statistics.fmean(hidden) if hidden else None} if stats else {}),
    }


class Bench:
    """What a per-feature benchmark measures with: where its ranks run, the timeout per job,
    the logs directory and a ``say`` for progress. Its methods block until their jobs end."""

    def __init__(self, emulate: bool, timeout: float, logs: str, say=print):
        self.emulate, self.timeout, self.logs, self.say = emulate, timeout, logs, say

    def hosts(self, ranks: int, bandwidth: str | None = None, **kwargs):
        return hosts(ranks, bandwidth, self.emulate, **kwargs)

    def repeat(self, cluster, jobs: dict[str, Job], repeats: int = 1) -> dict[str, list[dict]]:
        """Every job ``repeats`` times, interleaved (A, B, A, B, ...) so that a drift of the
        machine's speed hits all alike: per job name its results (:func:`run`, with the
        :func:`aggregate` figures for training jobs). Raises RuntimeError naming the log of a
        job that did not succeed: a per-feature table needs every figure."""
        runs: dict[str, list[dict]] = {name: [] for name in jobs}
        for _ in range(repeats):
            for name, job in jobs.items():
                r = run(job, cluster, self.timeout, self.logs)
                if r["status"] != "ok":
                    raise RuntimeError(f"{name}: {r['status']}: {r['message']} ({r['log']})")
                if "steps" in r["per_rank"][0]:
                    r.update(aggregate(r["per_rank"], job.args.get("batch", 32)))
                runs[name].append(r)
                self.say(f"{name}: {r['wall_s']:.0f} s" + (f", {r['step_s']:.3f} s/step" if
                         "step_s" in r else "") + f", load {os.getloadavg()[0]:.1f}")
        return runs


def feature_main(argv, doc: str, measure, table, emulated: bool = True,
                 choices: dict | None = None, **defaults) -> int:
    """The command line of a per-feature benchmark (``doc``: its module docstring; the first
    paragraph is the description, the second the usage). Common options, those named in
    ``defaults`` with their defaults (a list: one or more values; False: a bare flag) and
    ``choices`` (name → allowed values); ``measure(args, bench) -> results`` (JSON-able, kept
    with ``--json``) and ``table(results) -> lines``, printed; ``--from-json`` prints the
    table of saved results without measuring. Not ``emulated``: the ranks always run on this
    machine."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], allow_abbrev=False,
                                usage=doc.split("\n\n")[1].strip())
    if emulated:
        p.add_argument("--no-netns", action="store_true",
                       help="no emulated hosts: all ranks unshaped on this machine's loopback")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    p.add_argument("--logs", help="directory for the jobs' logs (default: a new one in /tmp)")
    p.add_argument("--json", help="write every figure to this file")
    p.add_argument("--from-json", help="print the table of an earlier --json file")
    for name, value in defaults.items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            p.add_argument(flag, action="store_true")
        else:
            kind = type(value[0]) if isinstance(value, list) else type(value)
            p.add_argument(flag, type=kind, default=value,
                           nargs="+" if isinstance(value, list) else None,
                           choices=(choices or {}).get(name))
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        emulate, where = emulation(args.no_netns) if emulated else (False, "this machine")
        logs = tempfile.mkdtemp(prefix="tfp-bench-", dir=args.logs)
        print(f"Hosts: {where}\nLogs: {logs}\nLoad average: {os.getloadavg()[0]:.1f}", flush=True)
        results = measure(args, Bench(emulate, args.timeout, logs, lambda t: print(t, flush=True)))
        results["load_at_end"] = os.getloadavg()[0]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print("\n" + "\n".join(table(results)))
    return 0


def model_args(args) -> dict:
    """The worker flags of a per-feature benchmark's model options."""
    keys = ("model", "width", "layers", "batch", "warmup", "steps")
    return {"model": "mlp"} | {k: getattr(args, k) for k in keys if hasattr(args, k)}
