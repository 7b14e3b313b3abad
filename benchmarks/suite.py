"""The benchmark suite: tf_poseidon against TensorFlow's MultiWorkerMirroredStrategy on an
emulated commodity-Ethernet cluster.

::

    python -m benchmarks.suite                 # all models; 2 hosts at 1 and 10 gbit, 4 hosts
                                               # at 1 gbit (54 min on an idle 2-core machine)
    python -m benchmarks.suite --quick         # a few minutes: FC model, 2 hosts, 1 gbit
    python -m benchmarks.suite --models fc --ranks 2 --bandwidths 1gbit --steps 8
    python -m benchmarks.suite --list          # the configurations and models
    python -m benchmarks.suite --report-only docs/benchmarks/results.json  # rewrite md + png

Run from the repository root, as root (network namespaces), with the venv active. The
one-process references run first, once per model; then for every (ranks, bandwidth) one
cluster (benchmarks/runner.py: an EmulatedCluster, or unshaped loopback with ``--no-netns`` or
where namespaces cannot be built) runs every model and configuration (benchmarks/report.py:
CONFIGS). After every configuration the results so far are written (``--out``: the results
block of benchmarks.md, and benchmarks.png; ``--json``: the raw run), so a run interrupted by
Ctrl-C, a crash or a timeout keeps what it measured. A tf_poseidon option the strategy refuses
with NotImplementedError is recorded as "not available: <message>" (checked first with
``tf_poseidon.config.StrategyConfig``, and caught by the worker too). Blocks for the whole run;
prints progress and at the end the result and goal tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from benchmarks import report, runner
from benchmarks.models import MODELS
from benchmarks.report import CONFIG_BY_NAME, CONFIGS, Config

ROOT = runner.ROOT
FULL = {"models": ["fc", "vgg", "resnet"], "ranks": [2, 4], "bandwidths": ["1gbit", "10gbit"],
        "warmup": 1, "steps": 4, "timeout": 900.0,
        # Without --ranks/--bandwidths: 4 hosts at 1 gbit only. At 10 gbit this machine's 2
        # cores are the limit, not the link (docs/cluster.md), and 4 ranks on 2 cores would
        # measure only that again.
        "skip": [(4, "10gbit")]}
QUICK = {"models": ["fc"], "ranks": [2], "bandwidths": ["1gbit"], "warmup": 1, "steps": 2,
         "timeout": 300.0}


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


def job_for(config: Config, model: str, ranks: int, settings: dict) -> runner.Job:
    kind = "single" if config.kind == "concurrent" else config.kind
    return runner.Job(kind, ranks, {k: settings[k] for k in ("batch", "warmup", "steps")}
                      | {"model": model},
                      config.kwargs_for(ranks) if config.is_poseidon else None)


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


def run_suite(settings: dict, emulate: bool, emulation: str, save, command: str,
              say=print) -> dict:
    """Runs every planned configuration, calling ``save(run)`` after each; returns the run
    dict. Ctrl-C (or SIGTERM/SIGHUP while a cluster is open) ends the run early, status
    "interrupted", after saving what was measured."""
    run = {"command": command, "started": _now(), "finished": None, "status": "running",
           "settings": settings, "environment": environment(), "emulation": emulation,
           "results": []}
    if settings.get("logs"):
        os.makedirs(settings["logs"], exist_ok=True)
    logs = tempfile.mkdtemp(prefix="tfp-bench-", dir=settings.get("logs"))
    say(f"Logs of every configuration: {logs}")
    todo = plan(settings)
    t0, current = time.monotonic(), None
    try:
        for group in dict.fromkeys((ranks, bw) for ranks, bw, _, _ in todo):
            ranks, bandwidth = group
            pending = []
            for i, (_, _, model, config) in enumerate(todo):
                if (todo[i][0], todo[i][1]) != group:
                    continue
                where = f"({i + 1}/{len(todo)}) {model} {report.link_label(bandwidth, ranks)}"
                verdict = precheck(config, ranks)
                if verdict is None:
                    pending.append((where, model, config))
                    continue
                run["results"].append({"model": model, "config": config.name, "ranks": ranks,
                                       "bandwidth": bandwidth, "status": verdict[0],
                                       "message": verdict[1]})
                say(f"[{_clock(t0)}] {where} {config.name}: {verdict[0]}: {verdict[1]}")
            save(run)
            if not pending:
                continue
            with runner.hosts(ranks, bandwidth, emulate and ranks > 1) as cluster:
                for where, model, config in pending:
                    current = {"model": model, "config": config.name, "ranks": ranks,
                               "bandwidth": bandwidth}
                    say(f"[{_clock(t0)}] {where} {config.name} — {config.label}")
                    done = runner.run(job_for(config, model, ranks, settings), cluster,
                                      settings["timeout"], logs, say)
                    result = {**current, "status": done["status"], "message": done["message"]}
                    if done["status"] == "ok":
                        result.update(runner.aggregate(done["per_rank"], settings["batch"]))
                    result.update(wall_s=done["wall_s"], log=done["log"])
                    run["results"].append(result)
                    current = None
                    say(f"      → {_summary(result)}")
                    save(run)
        run["status"] = "complete"
    except (KeyboardInterrupt, SystemExit) as e:
        run["status"] = "interrupted"
        if current is not None:
            run["results"].append({**current, "status": "interrupted",
                                   "message": f"{type(e).__name__} during this configuration"})
        say(f"\n[{_clock(t0)}] interrupted; writing what was measured")
        if isinstance(e, SystemExit):
            raise
    finally:
        run["finished"] = _now()
        if run["status"] != "complete":
            mark_not_run(run, todo)
        save(run)
    return run


def mark_not_run(run: dict, todo) -> None:
    """Adds a "not run" result for every planned configuration the run did not reach."""
    seen = {(r["model"], r["config"], r["ranks"], r["bandwidth"]) for r in run["results"]}
    run["results"] += [{"model": model, "config": config.name, "ranks": ranks,
                        "bandwidth": bandwidth, "status": "not run",
                        "message": "the run ended before this configuration"}
                       for ranks, bandwidth, model, config in todo
                       if (model, config.name, ranks, bandwidth) not in seen]


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


def environment() -> dict[str, str]:
    """CPU, cores, memory, OS and the versions that matter, for the report."""
    def first(path: str, key: str) -> str:
        try:
            with open(path) as f:
                return next(line.split(":", 1)[1].strip() for line in f if line.startswith(key))
        except (OSError, StopIteration):
            return "unknown"

    def output(argv: list[str], **kwargs) -> str:
        done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
        return done.stdout.strip() or "unknown"

    import tf_poseidon
    from tf_poseidon.launcher import find_mpirun
    mem = first("/proc/meminfo", "MemTotal").split()[0]
    versions = output([sys.executable, "-c", "import tensorflow as tf, keras, mpi4py; "
                       "print(tf.__version__, keras.__version__, mpi4py.__version__)"],
                      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    tf_v, keras_v, mpi4py_v = (versions.split() + ["?"] * 3)[:3]
    return {
        "CPU": first("/proc/cpuinfo", "model name"),
        "cores": f"{os.cpu_count()} (usable by this process: {len(os.sched_getaffinity(0))})",
        "memory": f"{int(mem) / 2**20:.0f} GiB" if mem.isdigit() else mem,
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "TensorFlow": tf_v, "Keras": keras_v,
        "Open MPI": output([find_mpirun(), "--version"]).splitlines()[0], "mpi4py": mpi4py_v,
        "tf_poseidon commit": output(["git", "-C", ROOT, "describe", "--always", "--dirty"]),
        "tf_poseidon imported from": os.path.dirname(os.path.abspath(tf_poseidon.__file__)),
        "load average at start (1 min)": f"{os.getloadavg()[0]:.2f} (other jobs may share "
                                         "the machine: see the load column)",
    }


def saver(out: str, json_path: str):
    """``save(run)``: writes the run's JSON, the results block of OUT/benchmarks.md and
    OUT/benchmarks.png (each file replaced whole)."""
    def save(run: dict) -> None:
        for path in (out, os.path.dirname(os.path.abspath(json_path))):
            os.makedirs(path, exist_ok=True)
        with open(json_path + ".tmp", "w") as f:
            f.write(json.dumps(run, indent=1) + "\n")
        os.replace(json_path + ".tmp", json_path)
        report.write_markdown(run, os.path.join(out, "benchmarks.md"))
        try:
            report.chart(run, os.path.join(out, "benchmarks.png"))
        except ImportError as e:
            print(f"  (no chart: {e}; pip install '.[bench]')", flush=True)
    return save


def print_tables(run: dict, say=print) -> None:
    rows = report.derive(run["results"])
    say("\nResults (samples/s of all ranks; × compute = step ÷ one-process step):")
    for line in report.result_table(rows, markdown=False):
        say("  " + line)
    say("\nGoals (best tf_poseidon configuration):")
    for line in report.goal_table(report.goals(rows), markdown=False):
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
    p.add_argument("--ranks", nargs="+", type=int,
                   help=f"hosts, one rank each; default {FULL['ranks']}")
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
    p.add_argument("--json", help="raw results (default docs/benchmarks/results.json, or "
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
    pick = lambda key: getattr(args, key) if getattr(args, key) is not None else base[key]
    s = {"models": args.models or base["models"], "ranks": args.ranks or base["ranks"],
         "bandwidths": [None if b == "none" else b for b in (args.bandwidths
                                                              or base["bandwidths"])],
         "configs": args.configs or [c.name for c in CONFIGS], "warmup": pick("warmup"),
         "steps": pick("steps"), "timeout": pick("timeout"), "batch": args.batch,
         "quick": args.quick, "logs": os.path.abspath(args.logs) if args.logs else None,
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
                              else os.path.join(ROOT, "docs", "benchmarks", "results.json"))
    save = saver(out, json_path)
    if args.report_only:
        with open(args.report_only) as f:
            run = json.load(f)
        if run.get("status") != "complete":
            mark_not_run(run, plan(run["settings"]))
        save(run)
        print_tables(run)
        return 0
    try:
        settings = settings_from(args)
    except ValueError as e:
        parser.error(str(e))
    emulate, emulation = runner.emulation(args.no_netns)
    if not emulate:
        settings["bandwidths"] = [None]
    command = "python -m benchmarks.suite " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"Emulation: {emulation}", flush=True)
    run = run_suite(settings, emulate, emulation, save, command.strip(),
                    say=lambda text: print(text, flush=True))
    print_tables(run)
    print(f"\nWrote {out}/benchmarks.md, {out}/benchmarks.png, {json_path}")
    return 130 if run["status"] == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
