"""Starting real multi-rank jobs from tests: ``tfposeidon-run`` (Open MPI's mpirun) on loopback.

Tests import this module (pytest puts tests/ on sys.path). Jobs run with the Python running
the tests, in a working directory of the test's own, so they import the installed tf_poseidon.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")


def job_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1",
                "TF_POSEIDON_REQUIRE_OPS": "1"})
    env.update(extra or {})
    return env


def run_job(num_ranks: int, worker: str, *args: str, timeout: float = 300,
            env: dict | None = None, cwd: str | None = None,
            mpi_args: str = "") -> tuple[subprocess.CompletedProcess, float]:
    """Runs ``tests/workers/<worker>`` on ``num_ranks`` ranks; returns (result, seconds).

    ``num_ranks == 0`` runs it as a plain process, with no launcher at all. Output (stdout and
    stderr merged) is in ``result.stdout``. Raises subprocess.TimeoutExpired after ``timeout``.
    """
    script = os.path.join(WORKERS, worker)
    if num_ranks == 0:
        argv = [sys.executable, script, *args]
    else:
        argv = [sys.executable, "-m", "tf_poseidon.launcher", "-np", str(num_ranks)]
        if mpi_args:
            argv.append(f"--mpi-args={mpi_args}")
        argv += [sys.executable, script, *args]
    start = time.monotonic()
    result = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            timeout=timeout, env=job_env(env), cwd=cwd or tempfile.gettempdir())
    # Decoded by hand: text mode would turn the progress bars' carriage returns into newlines.
    result.stdout = result.stdout.decode("utf-8", errors="replace")
    return result, time.monotonic() - start


def runs_by_world_size(tmp_path_factory, worker: str, runs: dict[int, dict[str, str]]):
    """``get(world size, run name)`` -> that run's output directory. ``runs``: world size (0:
    one plain process) -> run name -> the worker's arguments for it; one job per world size,
    run on first use, passes each run as one argument "OUT ARGS" (the workers take
    ``RUN [RUN ...]``)."""
    done = {}

    def get(num_ranks: int, name: str):
        if num_ranks not in done:
            root = tmp_path_factory.mktemp(f"{os.path.splitext(worker)[0]}_p{num_ranks}")
            for run in runs[num_ranks]:
                (root / run).mkdir()
            check(run_job(num_ranks, worker, *[
                f"{root / run} {args}" for run, args in runs[num_ranks].items()])[0])
            done[num_ranks] = root
        return done[num_ranks] / name
    return get


def check(result: subprocess.CompletedProcess) -> str:
    """The job's output; fails the test with that output if the job exited non-zero."""
    assert result.returncode == 0, f"job failed ({result.returncode}):\n{result.stdout[-6000:]}"
    return result.stdout
