"""The benchmark suite: tf_poseidon against TensorFlow's MultiWorkerMirroredStrategy on an
emulated commodity-Ethernet cluster (docs/benchmarks.md).

    python -m benchmarks.suite                 # all models; 2 hosts at 1 and 10 gbit, 4 hosts
                                               # at 1 gbit (54 min on an idle 2-core machine)
    python -m benchmarks.suite --models fc --ranks 2 --bandwidths 1gbit --steps 2 --out /tmp/q
    python -m benchmarks.suite --report-only docs/benchmarks/results.json  # rewrite md + png

From the repository root, as root (network namespaces). The one-process references run first,
then per (ranks, bandwidth) one cluster runs every model and configuration (report.CONFIGS).
After each configuration the run so far is saved in ``--out`` (docs/): benchmarks/results.json,
the results block of benchmarks.md and benchmarks.png, so that Ctrl-C, a crash or a timeout
keeps what was measured.
"""

import argparse
import datetime
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys

from benchmarks import report, runner
from benchmarks.models import MODELS
from benchmarks.report import CONFIG_BY_NAME, Config


def precheck(config: Config, ranks: int) -> tuple[str, str] | None:
    """("not available", message) or ("failed", "invalid options: ...") where the strategy's
    constructor refuses ``config`` at ``ranks`` ranks (checked here, without a job); else None."""
    if config.kind != "poseidon":
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
    """The job of ``config`` (concurrent: P single processes under mpirun); an autotuned
    configuration warms up for its trials too (comm/autotune.py: trial_steps)."""
    from tf_poseidon.comm import autotune
    options = config.kwargs_for(ranks) if config.kind == "poseidon" else None
    tuned = options is not None and options.get("autotune", True) and options.get(
        "mode", "sync") == "sync"
    warmup = settings["warmup"] + (autotune.trial_steps(
        options.get("compression", "none") != "none") if tuned else 0)
    return runner.Job("single" if config.kind == "concurrent" else config.kind, ranks,
                      {"model": model, "batch": settings["batch"], "warmup": warmup,
                       "steps": settings["steps"], "profile": settings.get("profile", 0)},
                      options)


def plan(settings: dict) -> list[tuple[int, str | None, str, Config]]:
    """(ranks, bandwidth, model, config) in running order: the one-process references, then
    per number of hosts and bandwidth every model and configuration."""
    configs, skip = [CONFIG_BY_NAME[c] for c in settings["configs"]], {
        tuple(x) for x in settings.get("skip", [])}
    return [(1, None, m, c) for m in settings["models"] for c in configs if c.kind == "single"] + [
        (ranks, bw, m, c) for ranks in settings["ranks"] for bw in settings["bandwidths"]
        if (ranks, bw) not in skip for m in settings["models"] for c in configs
        if c.kind != "single"]


def run_suite(settings: dict, bench: runner.Bench, emulation: str, save, command: str) -> dict:
    """Runs every planned configuration, calling ``save(run)`` after each (blocking); returns
    the run. Ctrl-C (or SIGTERM/SIGHUP while a cluster is open: SystemExit, raised again) ends
    it, status "interrupted", after saving what was measured."""
    run = {"command": command, "started": _now(), "finished": None, "status": "running",
           "settings": settings, "environment": environment(), "emulation": emulation,
           "results": []}
    todo, current = plan(settings), None
    print(f"Logs of every configuration: {bench.logs}", flush=True)
    try:
        for (ranks, bw), group in itertools.groupby(enumerate(todo), key=lambda t: t[1][:2]):
            with bench.hosts(ranks, bw) as cluster:
                for i, (_, _, model, config) in group:
                    current = {"model": model, "config": config.name, "ranks": ranks,
                               "bandwidth": bw}
                    print(f"({i + 1}/{len(todo)}) {model} {report.link_label(bw, ranks)} "
                          f"{config.name} — {config.label}", flush=True)
                    verdict = precheck(config, ranks)
                    if verdict:
                        current |= {"status": verdict[0], "message": verdict[1]}
                    else:
                        done = bench.run(cluster, job_for(config, model, ranks, settings))
                        current |= {k: v for k, v in done.items() if k != "per_rank"}
                    print(f"      → {current['status']}: " + (
                        f"{current['samples_per_s']:.1f} samples/s, {current['step_s']:.3f} "
                        f"s/step ({current['wall_s']:.0f} s)" if current["status"] == "ok"
                        else current["message"]), flush=True)
                    run["results"].append(current)
                    current = None
                    save(run)
        run["status"] = "complete"
    except (KeyboardInterrupt, SystemExit) as e:
        run["status"] = "interrupted"
        if current is not None:
            run["results"].append(current | {"status": "interrupted", "message":
                                             f"{type(e).__name__} during this configuration"})
        if isinstance(e, SystemExit):
            raise
    finally:
        run["finished"] = _now()
        mark_not_run(run, todo)
        save(run)
    return run


def mark_not_run(run: dict, todo) -> None:
    """Adds a "not run" result for every planned configuration the run has none for."""
    seen = {(r["model"], r["config"], r["ranks"], r["bandwidth"]) for r in run["results"]}
    run["results"] += [{"model": model, "config": config.name, "ranks": ranks, "bandwidth": bw,
                        "status": "not run", "message": "the run ended before this configuration"}
                       for ranks, bw, model, config in todo
                       if (model, config.name, ranks, bw) not in seen]


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def environment() -> dict[str, str]:
    """CPU, cores, memory, OS and the versions that matter, for the report."""
    import tf_poseidon  # first: it sizes TensorFlow's thread pools
    import keras
    import mpi4py
    import tensorflow as tf
    from tf_poseidon.launcher import find_mpirun

    def out(*argv):
        return subprocess.run(argv, capture_output=True, text=True).stdout.strip() or "unknown"
    info = {key.strip(): value.strip() for path in ("/proc/cpuinfo", "/proc/meminfo")
            for key, _, value in (line.partition(":") for line in open(path)) if value}
    return {"CPU": info.get("model name", "unknown"),
            "cores": f"{os.cpu_count()} (usable by this process: {len(os.sched_getaffinity(0))})",
            "memory": f"{int(info['MemTotal'].split()[0]) / 2**20:.0f} GiB",
            "OS": f"{platform.system()} {platform.release()}",
            "Python": platform.python_version(), "TensorFlow": tf.__version__,
            "Keras": keras.__version__, "Open MPI": out(find_mpirun(), "--version").splitlines()[0],
            "mpi4py": mpi4py.__version__,
            "tf_poseidon commit": out("git", "-C", runner.ROOT, "describe", "--always", "--dirty"),
            "tf_poseidon imported from": os.path.dirname(os.path.abspath(tf_poseidon.__file__)),
            "load average at start (1 min)": f"{os.getloadavg()[0]:.2f} (other jobs may share "
                                             "the machine: see the load column)"}


def save_to(out: str):
    """``save(run)``: writes the run to OUT/benchmarks/results.json, its results block into
    OUT/benchmarks.md and its chart (with matplotlib) to OUT/benchmarks.png."""
    def save(run: dict) -> None:
        path = os.path.join(out, "benchmarks", "results.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps(run, indent=1) + "\n")
        os.replace(path + ".tmp", path)
        report.write_markdown(run, os.path.join(out, "benchmarks.md"))
        try:
            report.chart(run, os.path.join(out, "benchmarks.png"))
        except ImportError as e:
            print(f"  (no chart: {e}; pip install '.[bench]')", flush=True)
    return save


def print_tables(run: dict) -> None:
    rows = report.derive(run["results"])
    print("\n".join(["", "Results (samples/s of all ranks; × compute = step ÷ one-process step):",
                     *report.result_table(rows), "", "Goals (best tf_poseidon configuration):",
                     *report.goal_table(report.goals(rows))]), flush=True)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["fc", "vgg", "resnet"])
    p.add_argument("--ranks", nargs="+", type=int, help="hosts, one rank each; 2 4")
    p.add_argument("--bandwidths", nargs="+", help="tc rates, 'none' = unshaped; 1gbit 10gbit "
                   "(without --ranks or --bandwidths, 4 hosts at 1gbit only: at 10gbit this "
                   "machine's 2 cores are the limit, not the link: docs/cluster.md)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIG_BY_NAME),
                   default=list(CONFIG_BY_NAME))
    p.add_argument("--warmup", type=int, default=1, help="untimed steps (>= 1); 1")
    p.add_argument("--steps", type=int, default=4, help="timed steps; 4")
    p.add_argument("--batch", type=int, default=32, help="rows per rank per step; 32")
    p.add_argument("--profile", type=int, default=0, help="steps profiled after the timed ones "
                   "(tf_poseidon.profiling: where the step's time goes); 0")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration; 900")
    p.add_argument("--out", default=os.path.join(runner.ROOT, "docs"),
                   help="for benchmarks.md, benchmarks.png and benchmarks/results.json; docs/")
    p.add_argument("--logs", help="each run's logs go in a new tfp-bench-* directory here; /tmp")
    p.add_argument("--no-netns", action="store_true",
                   help="do not emulate hosts: all ranks unshaped on this machine's loopback")
    p.add_argument("--report-only", metavar="RUN_JSON",
                   help="rewrite benchmarks.md and .png from a saved run, measure nothing")
    return p


def settings_from(args: argparse.Namespace) -> dict:
    """The run's settings (saved with it) from the command line; ValueError for a value the
    suite cannot run."""
    s = {"models": args.models, "ranks": args.ranks or [2, 4],
         "bandwidths": [None if b == "none" else b for b in args.bandwidths or ["1gbit", "10gbit"]],
         "configs": args.configs, "warmup": args.warmup, "steps": args.steps,
         "profile": args.profile,
         "batch": args.batch, "timeout": args.timeout,
         "logs": os.path.abspath(args.logs) if args.logs else None,
         "skip": [] if args.ranks or args.bandwidths else [(4, "10gbit")]}
    if s["warmup"] < 1 or s["steps"] < 1:
        raise ValueError("--warmup and --steps must be at least 1 (the first step traces)")
    if any(r < 2 for r in s["ranks"]):
        raise ValueError("--ranks must be at least 2 (the one-process reference always runs "
                         "as the 'single' configuration)")
    for b in s["bandwidths"]:
        report.rate_bits(b)  # ValueError for a malformed rate
    return s


def main(argv=None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if os.path.realpath(os.path.join(args.out, "benchmarks")) == os.path.dirname(
            os.path.realpath(__file__)):
        parser.error("--out: its benchmarks/ is this package; results go beside docs, not code")
    save = save_to(args.out)
    if args.report_only:
        with open(args.report_only) as f:
            run = json.load(f)
        mark_not_run(run, plan(run["settings"]))
        save(run)
        print_tables(run)
        return 0
    try:
        settings = settings_from(args)
    except ValueError as e:
        parser.error(str(e))
    emulate, emulation = runner.emulation(args.no_netns)
    settings["bandwidths"] = settings["bandwidths"] if emulate else [None]
    print(f"Emulation: {emulation}", flush=True)
    bench = runner.Bench(emulate, settings["timeout"], settings["logs"])
    command = "python -m benchmarks.suite " + shlex.join(sys.argv[1:] if argv is None else argv)
    run = run_suite(settings, bench, emulation, save, command.strip())
    print_tables(run)
    print(f"\nWrote benchmarks.md, benchmarks.png and benchmarks/results.json in {args.out}")
    return 130 if run["status"] == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main())
