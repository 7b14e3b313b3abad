"""The benchmark suite: tf_poseidon against TensorFlow's MultiWorkerMirroredStrategy on an
emulated commodity-Ethernet cluster.

::

    python -m benchmarks.suite                 # full run: all models; 2 hosts at 1 and 10 gbit,
                                               # 4 hosts at 1 gbit (estimated 60-90 min on an
                                               # idle 2-core machine, not yet run in full)
    python -m benchmarks.suite --quick         # a few minutes: FC model, 2 hosts, 1 gbit
    python -m benchmarks.suite --models fc --ranks 2 --bandwidths 1gbit --steps 8
    python -m benchmarks.suite --list          # the configurations and models
    python -m benchmarks.suite --report-only benchmarks/results.json   # rewrite md + png

Run from the repository root, as root (network namespaces), with the venv active. For every
(ranks, bandwidth) it builds a :class:`tf_poseidon.testing.EmulatedCluster` — one network
namespace per rank ("host"), each host's link shaped with tc tbf in both directions, joined
by a bridge — and runs every configuration there with a real multi-host ``mpirun`` over TCP
(``tfposeidon-run`` with the cluster's ``launcher_args()`` for tf_poseidon, the cluster's
``mpirun_args()`` for MultiWorkerMirroredStrategy and the no-communication reference). The
one-process compute-only reference runs first, once per model, outside any cluster. Where
namespaces cannot be built (not root, no ``ip``/``tc``) it says so and runs everything
unshaped on loopback (no per-host wire bytes then).

After every configuration the results so far are written (``--out``: benchmarks.md and
benchmarks.png; ``--json``: the raw run), so a run interrupted by Ctrl-C, a crash or a
timeout keeps what it measured; each configuration has a timeout (``--timeout``). The
cluster is torn down on every exit path (EmulatedCluster does it). A tf_poseidon option that
raises NotImplementedError is recorded as "not available: <message>" and the suite goes on:
the options are first checked with ``tf_poseidon.config.StrategyConfig`` (what the strategy's
constructor validates with), and the worker catches the error from the constructor too.

Blocks for the whole run; prints progress (each configuration, each step of rank 0) and at
the end the result and goal tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

if __package__ in (None, ""):
    # Run as a file (python benchmarks/X.py): make the ``benchmarks`` package importable by
    # appending the repository root, after everything else, so that an installed tf_poseidon
    # is not shadowed by the checkout; and drop this directory (its module names are generic).
    _HERE = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
        del sys.path[0]
    sys.path.append(os.path.dirname(_HERE))

from benchmarks import report
from benchmarks.models import MODELS
from benchmarks.report import CONFIG_BY_NAME, CONFIGS, Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MWMS_PORT = 23456  # each emulated host has its own network namespace, so one port for all
RANK_ENV = {
    "TF_NUM_INTRAOP_THREADS": "1",      # one compute thread per rank (TF's own variable)
    "TF_POSEIDON_INTRA_THREADS": "1",   # the same for tf_poseidon's placement
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
}
FULL = {"models": ["fc", "vgg", "resnet"], "ranks": [2, 4], "bandwidths": ["1gbit", "10gbit"],
        "warmup": 1, "steps": 4, "timeout": 900.0,
        # Without --ranks/--bandwidths: 4 hosts at 1 gbit only. At 10 gbit this machine's 2
        # cores are the limit, not the link (docs/cluster.md), and 4 ranks on 2 cores would
        # measure only that again; leaving it out keeps the full run (estimated from the
        # 2-host runs) within 60-90 minutes on an idle machine.
        "skip": [(4, "10gbit")]}
QUICK = {"models": ["fc"], "ranks": [2], "bandwidths": ["1gbit"], "warmup": 1, "steps": 2,
         "timeout": 300.0}


# -- where the ranks run ----------------------------------------------------------------------


class LocalHosts:
    """The no-namespace fallback with EmulatedCluster's interface: ``ranks`` processes on
    this machine's loopback, unshaped. Kills what it started on exit."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.hosts = ["localhost"] * ranks
        self._procs: list[subprocess.Popen] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        for proc in self._procs:
            _kill_group(proc)

    def peers(self) -> list[str]:
        ports = []
        for _ in range(self.ranks):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        return [f"127.0.0.1:{p}" for p in ports]

    def mpirun_args(self, slots_per_host: int = 1) -> list[str]:
        from tf_poseidon.launcher import find_mpirun
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        return [find_mpirun(), *root, "-np", str(self.ranks), "--oversubscribe",
                "--bind-to", "none"]

    def launcher_args(self, slots_per_host: int = 1) -> list[str]:
        return ["-np", str(self.ranks)]

    def run(self, argv: Sequence[str], *, host: str | None = None, timeout: float = 120.0,
            env: dict | None = None) -> subprocess.CompletedProcess:
        """Runs ``argv`` in its own process group; kills the group on timeout (raising
        TimeoutExpired) or on any exception. Blocks until it exits."""
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


def cluster_for(ranks: int, bandwidth: str | None, emulate: bool):
    """An EmulatedCluster of ``ranks`` hosts at ``bandwidth``, or the loopback fallback
    (LocalHosts). Use with ``with``: the exit tears everything down."""
    if not emulate:
        return LocalHosts(ranks)
    from tf_poseidon.testing import EmulatedCluster
    return EmulatedCluster(ranks, bandwidth)


def nic_of(cluster) -> str | None:
    """The interface whose counters are a host's traffic: eth0 of an emulated host; None on
    the shared loopback (other processes' traffic would be counted too)."""
    return None if isinstance(cluster, LocalHosts) else "eth0"


def mwms_peers(cluster) -> list[str]:
    """host:port of every MWMS worker, in rank order (mpirun places rank i on host i)."""
    if isinstance(cluster, LocalHosts):
        return cluster.peers()
    return [f"{cluster.addresses[h]}:{MWMS_PORT}" for h in cluster.hosts]


# -- one configuration ------------------------------------------------------------------------


def precheck(config: Config, ranks: int) -> tuple[str, str] | None:
    """Checks ``config``'s options for ``ranks`` ranks as the strategy's constructor does
    (tf_poseidon.config.StrategyConfig), without starting a job. Returns ("not available",
    the NotImplementedError's message), ("failed", "invalid options: " + the ValueError's),
    or None when the job should run."""
    if not config.is_poseidon:
        return None
    from tf_poseidon.config import StrategyConfig
    try:
        StrategyConfig(**config.kwargs_for(ranks))
    except NotImplementedError as e:
        return "not available", str(e)
    except ValueError as e:
        return "failed", f"invalid options: {e}"
    return None


def command_for(config: Config, cluster, model: str, name: str, settings: dict,
                rundir: str) -> list[str]:
    """The argv (run on the cluster's first host) for ``config``."""
    # The worker runs as a file: the ranks then import tf_poseidon as the environment says
    # (rank_env), not necessarily from the directory they start in.
    worker = [sys.executable, os.path.join(ROOT, "benchmarks", "worker.py"), "--model", model,
              "--name", name,
              "--out", rundir, "--batch", str(settings["batch"]), "--warmup",
              str(settings["warmup"]), "--steps", str(settings["steps"])]
    if nic_of(cluster):
        worker += ["--nic", nic_of(cluster)]
    forward = [x for var in ["PATH", *rank_env()] for x in ("-x", var)]
    if config.kind == "single":
        return [*worker, "--kind", "single"]
    if config.kind == "concurrent":
        return [*cluster.mpirun_args(), *forward, *worker, "--kind", "single"]
    if config.kind == "mwms":
        peer_hosts = ",".join(cluster.hosts) if nic_of(cluster) else ""
        return [*cluster.mpirun_args(), *forward, *worker, "--kind", "mwms",
                "--peers", ",".join(mwms_peers(cluster)), "--peer-hosts", peer_hosts]
    return [sys.executable, "-m", "tf_poseidon.launcher", *cluster.launcher_args(),
            *worker, "--kind", "poseidon", "--options",
            json.dumps(config.kwargs_for(len(cluster.hosts)))]


def rank_env() -> dict[str, str]:
    """What every rank's environment gets on top of the suite's: one compute thread, and a
    PYTHONPATH under which the ranks import the same tf_poseidon as the suite (the checkout's
    if that is the one the suite imported; else the user's PYTHONPATH is left as it is)."""
    import tf_poseidon
    env = dict(RANK_ENV)
    path = os.environ.get("PYTHONPATH", "")
    origin = os.path.dirname(os.path.dirname(os.path.abspath(tf_poseidon.__file__)))
    if origin == ROOT and ROOT not in path.split(os.pathsep):
        path = os.pathsep.join(filter(None, [ROOT, path]))
    if path:
        env["PYTHONPATH"] = path
    return env


def run_config(config: Config, cluster, model: str, ranks: int, bandwidth: str | None,
               settings: dict, rundir: str, say) -> dict:
    """Runs one configuration to completion (or its timeout) and returns its result dict.
    Shows rank 0's progress lines while it waits. KeyboardInterrupt passes through (the
    caller's cluster teardown ends the job)."""
    name = f"{model}-{config.name}-{ranks}-{bandwidth or 'none'}".replace("+", "_")
    result = {"model": model, "config": config.name, "ranks": ranks, "bandwidth": bandwidth,
              "status": "ok", "message": ""}
    argv = command_for(config, cluster, model, name, settings, rundir)
    outcome: dict = {}

    def target():
        try:
            outcome["done"] = cluster.run(argv, timeout=settings["timeout"], env=rank_env())
        except BaseException as e:  # reported by the main thread
            outcome["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    progress_path = os.path.join(rundir, f"{name}.progress")
    shown = 0
    while thread.is_alive():
        thread.join(1.0)
        shown = _show_progress(progress_path, shown, say)
    _show_progress(progress_path, shown, say)
    result["wall_s"] = time.monotonic() - start

    done = outcome.get("done")
    error = outcome.get("error")
    log = ""
    if done is not None:
        log = (done.stdout or "") + (done.stderr or "")
    elif isinstance(error, subprocess.TimeoutExpired):
        log = _text(error.stdout) + _text(error.stderr)
    with open(os.path.join(rundir, f"{name}.log"), "w") as f:
        f.write(shlex.join(argv) + "\n\n" + log)

    rank_files = [os.path.join(rundir, f"{name}.rank{r}.json") for r in range(ranks)]
    per_rank = [json.load(open(p)) for p in rank_files if os.path.exists(p)]
    if isinstance(error, subprocess.TimeoutExpired):
        result.update(status="timed out",
                      message=f"no result within {settings['timeout']:g} s; "
                              f"last progress: {_last_line(progress_path)}")
    elif error is not None:
        raise error
    elif any(r["status"] == "not available" for r in per_rank):
        result.update(status="not available",
                      message=next(r["message"] for r in per_rank
                                   if r["status"] == "not available"))
    elif done.returncode != 0 or len(per_rank) < ranks:
        result.update(status="failed",
                      message=f"exit {done.returncode}, {len(per_rank)}/{ranks} ranks "
                              f"reported; {_error_line(log)}")
    else:
        result.update(aggregate(per_rank, settings["batch"]))
    result["log"] = os.path.join(rundir, f"{name}.log")
    return result


def aggregate(per_rank: list[dict], batch: int) -> dict:
    """The result figures from the ranks' files: samples/s of all ranks together (all
    timed samples over the slowest rank's timed wall time: a rank running ahead, as SSP and
    EASGD allow, does not count for more than the job finishes), the slowest rank's step
    time, and per-host wire bytes per timed step."""
    per_rank = sorted(per_rank, key=lambda r: r["rank"])
    steps = per_rank[0]["steps"]
    step_times = [t for r in per_rank for t in r["step_times_s"]]
    slowest = max(per_rank, key=lambda r: r["window_s"])
    out = {
        "samples_per_s": sum(batch * r["steps"] for r in per_rank) / slowest["window_s"],
        "step_s": slowest["window_s"] / slowest["steps"],
        "step_median_s": sorted(slowest["step_times_s"])[len(slowest["step_times_s"]) // 2],
        "step_min_s": min(step_times),
        "steps": steps,
        "first_step_s": max(r["first_step_s"] for r in per_rank),
        "tx_bytes_per_step": [r["tx_bytes"] / r["steps"] if "tx_bytes" in r else None
                              for r in per_rank],
        "rx_bytes_per_step": [r["rx_bytes"] / r["steps"] if "rx_bytes" in r else None
                              for r in per_rank],
        "windows_s": [r["window_s"] for r in per_rank],
        "hosts": [r["host"] for r in per_rank],
        "affinity_cpus": [r["affinity_cpus"] for r in per_rank],
        "loadavg": max(r["loadavg"] for r in per_rank),
    }
    stats = [r.get("poseidon_stats") for r in per_rank if r.get("poseidon_stats")]
    if stats:
        sent = [s.get("bytes_sent") for s in stats if s.get("bytes_sent") is not None]
        hidden = [s.get("hidden_fraction") for s in stats
                  if s.get("hidden_fraction") is not None]
        out["engine_bytes_per_step"] = max(sent) if sent else None
        out["hidden_fraction"] = sum(hidden) / len(hidden) if hidden else None
    return out


def _text(value) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _show_progress(path: str, shown: int, say) -> int:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return shown
    for line in lines[shown:]:
        say(f"      {line}")
    return len(lines)


def _last_line(path: str) -> str:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
        return lines[-1] if lines else "none (did not start training)"
    except OSError:
        return "none (did not start training)"


_NOISE = ("WARNING: All log messages before absl::InitializeLog()", "oneDNN custom operations",
          "cpu_feature_guard", "To enable the following instructions")


def _error_line(log: str) -> str:
    """The most telling line of a failed job's output: the first Python exception line
    (``SomeError: ...``; the rank that failed first prints it first), else the last line
    mentioning an error, else the last line that is not TensorFlow's start-up chatter."""
    lines = [line.strip() for line in log.splitlines()
             if line.strip() and not any(n in line for n in _NOISE)]
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b.*:", line)]
    if raised:
        return raised[0][:400]
    errors = [line for line in lines if re.search(r"\b\w*(Error|Exception)\b", line)
              or "Killed" in line or "ABORT" in line.upper()]
    found = errors or lines
    return found[-1][:400] if found else "no output"


# -- the whole run ----------------------------------------------------------------------------


def environment() -> dict[str, str]:
    """CPU, cores, memory, OS and the versions that matter, for the report."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = "unknown"
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
            mem = f"{kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    versions = subprocess.run(
        [sys.executable, "-c", "import tensorflow as tf, keras, mpi4py; "
         "print(tf.__version__, keras.__version__, mpi4py.__version__)"],
        capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    tf_v, keras_v, mpi4py_v = (versions.stdout.split() + ["?"] * 3)[:3]
    try:
        from tf_poseidon.launcher import find_mpirun
        ompi = subprocess.run([find_mpirun(), "--version"], capture_output=True,
                              text=True).stdout.splitlines()[0]
    except Exception as e:  # the report says what went wrong instead
        ompi = f"unknown ({e})"
    git = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                         capture_output=True, text=True).stdout.strip() or "unknown"
    return {
        "CPU": cpu,
        "cores": f"{os.cpu_count()} (usable by this process: {len(os.sched_getaffinity(0))})",
        "memory": mem,
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "TensorFlow": tf_v, "Keras": keras_v, "Open MPI": ompi, "mpi4py": mpi4py_v,
        "tf_poseidon commit": git,
        "tf_poseidon imported from": _tf_poseidon_dir(),
        "load average at start (1 min)": f"{os.getloadavg()[0]:.2f} (other jobs may share "
                                         "the machine: see the load column)",
    }


def _tf_poseidon_dir() -> str:
    import tf_poseidon
    return os.path.dirname(os.path.abspath(tf_poseidon.__file__))


class Output:
    """Writes the run's JSON, markdown and chart; called after every configuration."""

    def __init__(self, md_path: str, png_path: str, json_path: str):
        self.md_path, self.png_path, self.json_path = md_path, png_path, json_path

    def save(self, run: dict) -> None:
        for path in (self.md_path, self.png_path, self.json_path):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _atomic_write(self.json_path, json.dumps(run, indent=1) + "\n")
        _atomic_write(self.md_path, report.markdown(run))
        try:
            report.chart(run, self.png_path)
        except ImportError as e:
            print(f"  (no chart: {e}; pip install '.[bench]')", flush=True)


def _atomic_write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def plan(settings: dict) -> list[tuple[int, str | None, str, Config]]:
    """(ranks, bandwidth, model, config) in the order they run: the one-process references
    first, then per number of hosts and bandwidth every model and configuration."""
    configs = [CONFIG_BY_NAME[c] for c in settings["configs"]]
    steps = [(1, None, m, c) for m in settings["models"] for c in configs if c.kind == "single"]
    skip = {tuple(x) for x in settings.get("skip", [])}
    for ranks in settings["ranks"]:
        for bandwidth in settings["bandwidths"]:
            if (ranks, bandwidth) not in skip:
                steps += [(ranks, bandwidth, m, c) for m in settings["models"] for c in configs
                          if c.kind != "single"]
    return steps


def run_suite(settings: dict, emulate: bool, emulation: str, output: Output, command: str,
              say=print) -> dict:
    """Runs every planned configuration, saving after each; returns the run dict. Ctrl-C
    ends the run early (status "interrupted") after saving what was measured."""
    run = {"command": command, "started": _now(), "finished": None, "status": "running",
           "settings": settings, "environment": environment(), "emulation": emulation,
           "results": []}
    if settings.get("logs"):
        os.makedirs(settings["logs"], exist_ok=True)
    rundir = tempfile.mkdtemp(prefix="tfp-bench-", dir=settings.get("logs"))
    say(f"Logs of every configuration: {rundir}")
    todo = plan(settings)
    t0 = time.monotonic()
    current = None
    try:
        index = 0
        groups: list[tuple[int, str | None]] = []
        for ranks, bandwidth, _, _ in todo:
            if (ranks, bandwidth) not in groups:
                groups.append((ranks, bandwidth))
        for ranks, bandwidth in groups:
            mine = [t for t in todo if t[:2] == (ranks, bandwidth)]
            pending = []
            for _, _, model, config in mine:
                index += 1
                verdict = precheck(config, ranks)
                if verdict is not None:
                    status, why = verdict
                    run["results"].append({"model": model, "config": config.name,
                                           "ranks": ranks, "bandwidth": bandwidth,
                                           "status": status, "message": why})
                    say(f"[{_clock(t0)}] ({index}/{len(todo)}) {model} "
                        f"{report.link_label(bandwidth, ranks)} {config.name}: {status}: "
                        f"{why}")
                else:
                    pending.append((index, model, config))
            output.save(run)
            if not pending:
                continue
            if ranks > 1:
                say(f"[{_clock(t0)}] building {report.link_label(bandwidth, ranks)}")
            with cluster_for(ranks, bandwidth if emulate else None, emulate and ranks > 1) \
                    as cluster:
                for i, model, config in pending:
                    current = (model, config.name, ranks, bandwidth)
                    say(f"[{_clock(t0)}] ({i}/{len(todo)}) {model} "
                        f"{report.link_label(bandwidth, ranks)} {config.name} — {config.label}")
                    result = run_config(config, cluster, model, ranks, bandwidth, settings,
                                        rundir, say)
                    current = None
                    run["results"].append(result)
                    say(f"      → {_summary(result)}")
                    output.save(run)
        run["status"] = "complete"
    except (KeyboardInterrupt, SystemExit) as e:
        # Ctrl-C, or SIGTERM/SIGHUP (SystemExit while a cluster is open); the cluster has
        # been torn down by now. SystemExit goes on after the results are saved.
        run["status"] = "interrupted"
        if current is not None:
            model, name, ranks, bandwidth = current
            run["results"].append({"model": model, "config": name, "ranks": ranks,
                                   "bandwidth": bandwidth, "status": "interrupted",
                                   "message": f"{type(e).__name__} during this configuration"})
        say(f"\n[{_clock(t0)}] interrupted; writing what was measured")
        if isinstance(e, SystemExit):
            raise
    finally:
        run["finished"] = _now()
        if run["status"] != "complete":
            mark_not_run(run, todo)
        output.save(run)
    return run


def mark_not_run(run: dict, todo) -> None:
    """Adds a "not run" result for every planned configuration the run did not reach."""
    seen = {(r["model"], r["config"], r["ranks"], r["bandwidth"]) for r in run["results"]}
    for ranks, bandwidth, model, config in todo:
        if (model, config.name, ranks, bandwidth) not in seen:
            run["results"].append({"model": model, "config": config.name, "ranks": ranks,
                                   "bandwidth": bandwidth, "status": "not run",
                                   "message": "the run ended before this configuration"})


def _summary(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r['message']}"
    wire = [b for b in r.get("tx_bytes_per_step") or [] if b is not None]
    text = f"{r['samples_per_s']:.1f} samples/s, {r['step_s']:.3f} s/step"
    if wire:
        text += f", {max(wire) / 1e6:.1f} MB/step sent by the busiest host"
    return text + f" ({r['wall_s']:.0f} s)"


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _clock(t0: float) -> str:
    s = int(time.monotonic() - t0)
    return f"{s // 60:3d}:{s % 60:02d}"


def print_tables(run: dict, say=print) -> None:
    rows = report.derive(run["results"])
    say("\nResults (samples/s of all ranks; × compute = step ÷ one-process step):")
    for line in report.result_table(rows, markdown=False):
        say("  " + line)
    say("\nGoals (best tf_poseidon configuration):")
    for line in report.goal_table(report.goals(rows), markdown=False):
        say("  " + line)
    say("\nDESIGN.md anchors vs this run:")
    for line in report.anchor_table(rows, markdown=False):
        say("  " + line)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.suite", allow_abbrev=False,
        description="tf_poseidon vs MultiWorkerMirroredStrategy on an emulated Ethernet "
                    "cluster (one network namespace per rank, shaped links). Needs root.")
    p.add_argument("--quick", action="store_true",
                   help=f"a few minutes: {QUICK['models']}, ranks {QUICK['ranks']}, "
                        f"{QUICK['bandwidths']}, {QUICK['warmup']}+{QUICK['steps']} steps; "
                        "writes to benchmarks/quick-results/ unless --out is given")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS),
                   help=f"default {FULL['models']}")
    p.add_argument("--ranks", nargs="+", type=int, help=f"hosts, one rank each; "
                                                         f"default {FULL['ranks']}")
    p.add_argument("--bandwidths", nargs="+",
                   help=f"link rates (tc: 1gbit, 10gbit, 500mbit; 'none' = unshaped); "
                        f"default {FULL['bandwidths']} (without --ranks/--bandwidths, 4 hosts "
                        "run at 1gbit only)")
    p.add_argument("--configs", nargs="+", choices=[c.name for c in CONFIGS],
                   help="default: all (see --list)")
    p.add_argument("--warmup", type=int, help=f"untimed steps (>= 1); default {FULL['warmup']}")
    p.add_argument("--steps", type=int, help=f"timed steps; default {FULL['steps']}")
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step (32)")
    p.add_argument("--timeout", type=float,
                   help=f"seconds per configuration; default {FULL['timeout']:g}")
    p.add_argument("--out", help="directory for benchmarks.md and benchmarks.png "
                                 "(default docs/, or benchmarks/quick-results/ with --quick)")
    p.add_argument("--json", help="raw results (default benchmarks/results.json, or "
                                  "benchmarks/quick-results/results.json with --quick)")
    p.add_argument("--logs", help="directory under which each run keeps its logs and rank "
                                  "files (default: a new tfp-bench-* directory in /tmp)")
    p.add_argument("--no-netns", action="store_true",
                   help="do not emulate hosts: all ranks unshaped on this machine's loopback")
    p.add_argument("--list", action="store_true", help="print configurations and models")
    p.add_argument("--report-only", metavar="RUN_JSON",
                   help="rewrite benchmarks.md and .png from a saved run, measure nothing")
    return p


def settings_from(args: argparse.Namespace) -> dict:
    base = QUICK if args.quick else FULL
    s = {"models": args.models or base["models"], "ranks": args.ranks or base["ranks"],
         "bandwidths": [None if b == "none" else b for b in (args.bandwidths
                                                              or base["bandwidths"])],
         "configs": args.configs or [c.name for c in CONFIGS],
         "warmup": args.warmup if args.warmup is not None else base["warmup"],
         "steps": args.steps if args.steps is not None else base["steps"],
         "timeout": args.timeout if args.timeout is not None else base["timeout"],
         "batch": args.batch, "quick": args.quick,
         "logs": os.path.abspath(args.logs) if args.logs else None,
         "skip": [] if args.ranks or args.bandwidths else base.get("skip", [])}
    if s["warmup"] < 1 or s["steps"] < 1:
        raise ValueError("--warmup and --steps must be at least 1 (the first step traces)")
    if any(r < 2 for r in s["ranks"]):
        raise ValueError("--ranks must be at least 2 (the one-process reference always runs "
                         "as the 'single' configuration)")
    for b in s["bandwidths"]:
        report.rate_bits(b)  # ValueError for a malformed rate
    return s


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.list:
        for c in CONFIGS:
            print(f"{c.name:<11} {c.label}  {c.kwargs if c.is_poseidon else ''}")
        for m in MODELS.values():
            print(f"model {m.name:<7} {m.title}, input {m.input_shape}")
        return 0
    quick_dir = os.path.join(ROOT, "benchmarks", "quick-results")
    out = args.out or (quick_dir if args.quick else os.path.join(ROOT, "docs"))
    json_path = args.json or (os.path.join(quick_dir, "results.json") if args.quick
                              else os.path.join(ROOT, "benchmarks", "results.json"))
    output = Output(os.path.join(out, "benchmarks.md"), os.path.join(out, "benchmarks.png"),
                    json_path)
    if args.report_only:
        with open(args.report_only) as f:
            run = json.load(f)
        refresh_failure_messages(run)
        if run.get("status") != "complete":
            mark_not_run(run, plan(run["settings"]))
        output.save(run)
        print_tables(run)
        return 0
    try:
        settings = settings_from(args)
    except ValueError as e:
        parser.error(str(e))
    emulate, emulation = decide_emulation(args.no_netns, settings)
    if not emulate:
        settings["bandwidths"] = [None]
    prog = "python -m benchmarks.suite" if __package__ else "python benchmarks/suite.py"
    command = prog + " " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    print(f"Emulation: {emulation}", flush=True)
    run = run_suite(settings, emulate, emulation, output, command.strip(),
                    say=lambda text: print(text, flush=True))
    print_tables(run)
    print(f"\nWrote {output.md_path}, {output.png_path}, {output.json_path}")
    return 130 if run["status"] == "interrupted" else 0


def refresh_failure_messages(run: dict) -> None:
    """Re-reads the error line of failed configurations from their logs, where the logs
    still exist (so that a better :func:`_error_line` applies to a saved run)."""
    for r in run["results"]:
        log = r.get("log")
        if r["status"] == "failed" and log and os.path.exists(log):
            with open(log, errors="replace") as f:
                text = f.read()
            head, sep, _ = r["message"].partition("; ")
            r["message"] = f"{head}{sep or '; '}{_error_line(text)}"


def decide_emulation(no_netns: bool, settings: dict) -> tuple[bool, str]:
    """(emulate?, a sentence for the report) — EmulatedCluster if this machine allows it."""
    unshaped = ("all ranks on this machine's loopback, UNSHAPED (no bandwidth limit, no "
                "per-host wire bytes): the figures do not describe a cluster")
    if no_netns:
        return False, f"--no-netns given: {unshaped}."
    from tf_poseidon.testing import available
    ok, why = available()
    if not ok:
        print(f"Cannot emulate hosts here ({why}); running unshaped on loopback instead.",
              flush=True)
        return False, f"emulated hosts not available ({why}): {unshaped}."
    return True, ("tf_poseidon.testing.EmulatedCluster — one network namespace per rank "
                  "(\"host\", own hostname), a veth pair from each host's `eth0` to a port of a "
                  "bridge in a switch namespace, both directions of every link shaped with "
                  "`tc tbf rate <bandwidth> burst 1mb latency 50ms` (full-duplex switched "
                  "Ethernet); real multi-host `mpirun` (rsh agent into the namespaces), TCP "
                  "over `eth0`. All hosts share this machine's cores.")


if __name__ == "__main__":
    sys.exit(main())
