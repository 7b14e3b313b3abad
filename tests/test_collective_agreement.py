"""Ranks that post different collectives fail fast, on every rank, with both sides named.

Before every group of buckets and every control-plane call the ranks agree on what they post
(comm/agreement.py); before fit/evaluate/predict they agree on the data they were given;
asynchronous EASGD's exchanges check that no rank has finished its fit (algorithms/easgd.py).
Each scenario of tests/workers/diverge.py runs at P=2 with Open MPI's rank-tagged output, read
as it comes: every rank must report the mismatch, naming both sides, within 10 s of the point
where the ranks go different ways, and the job must end non-zero within 30 s of it. The same
in one process, rank by rank: tests/test_agreement.py.
"""

import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from multirank import WORKERS, job_env

pytestmark = pytest.mark.multirank

REPORT_BOUND_S = 10  # from the divergence to each rank's report
END_BOUND_S = 30     # from the divergence to the end of the job
JOB_LIMIT_S = 300    # the whole job, start-up included, before the test gives up on it

MISMATCH = r"CollectiveMismatchError: the ranks posted different collectives: "
SCENARIOS = {
    # what each rank's report must say, all in its one line
    "chief_evaluate": [MISMATCH + r"rank 0 posted control-plane call 'input data'; rank 1 "
                       r"posted control-plane call 'end of program'\.",
                       r"reached the end of its program", r"if tp\.is_chief\(\)"],
    "callback": [MISMATCH + r"rank 0 posted reduce instance \d+ \(1 bucket: allreduce 4 B "
                 r"float32\); rank 1 posted gradients step \d+ \("],
    "terminate_on_nan": [MISMATCH + r"rank 0 posted control-plane call 'the meeting of all "
                         r"ranks at the end of an epoch'; rank 1 posted ssp_deltas instance "
                         r"\d+ \(", r"TerminateOnNaN stopped training on some ranks only"],
    "terminate_on_nan_easgd": [MISMATCH + r"rank 0 posted control-plane call 'an asynchronous "
                               r"EASGD exchange \(training\)'; rank 1 posted control-plane "
                               r"call 'the asynchronous EASGD meeting of a drain \(the end of "
                               r"fit\)'\.",
                               r"TerminateOnNaN stopped training on some ranks only"],
    "lengths_steps": [r"ValueError: the ranks were given different data \(rank 0: 4 batches "
                      r"of 32, the last of 4; rank 1: 5 batches of 32, the last of 2\)",
                      r"distribute_datasets_from_function"],
    "lengths_rows": [r"ValueError: the ranks were given different data \(rank 0: 4 batches of "
                     r"32, the last of 4; rank 1: 4 batches of 32, the last of 14\)"],
    "values": [r"ValueError: the ranks were given different data \(rank 0: 4 batches of 32, "
               r"the last of 4; rank 1: 4 batches of 32, the last of 4; the same sizes, other "
               r"values: arrays split or permuted at random on each rank, unseeded"],
    "chief_checkpoint": [MISMATCH + r"rank 0 posted control-plane call 'work of rank 0 that "
                         r"the other ranks wait for \(a save, a checkpoint, an export\)'; rank "
                         r"1 posted gradients step \d+ \(",
                         r"a callback that saves \(tp\.callbacks\.ModelCheckpoint, "
                         r"BackupAndRestore\) was given to fit on some ranks only"],
    "shards": [r"ValueError: the ranks were given different data \(rank 0: 4 batches, keeping "
               r"shard\(2, 0\); rank 1: 4 batches, keeping shard\(2, 1\)\)",
               r"Dataset\.shard\(num_workers, rank\) as in a Horovod script"],
    "loop_shards": [r"ValueError: the ranks were given different data \(rank 0: 4 batches, "
                    r"keeping shard\(2, 0\); rank 1: 4 batches, keeping shard\(2, 1\)\)\. "
                    r"fit, evaluate, predict and strategy\.experimental_distribute_dataset"],
    "loop_chief_checkpoint": [MISMATCH + r"rank 0 posted control-plane call 'work of rank 0 "
                              r"that the other ranks wait for \(a save, a checkpoint, an "
                              r"export\)'; rank 1 posted gradients step \d+ \(",
                              r"Some ranks were saving and others were not: a save \(model\."
                              r"save, save_weights or export, tf\.train\.Checkpoint or "
                              r"CheckpointManager\.save"],
    "cache": [r"ValueError: ranks 0, 1 on host \S+ would each write the cache file of "
              r"Dataset\.cache\('.*rows'\) at once: TensorFlow lets one process at a time "
              r"write a cache file"],
    "slices": [r"ValueError: the ranks were given different data \(rank 0: 4 batches; rank 1: "
               r"4 batches; the same sizes, other values: arrays split or permuted at random"],
}


def run_tagged(*args: str) -> tuple[int, list[tuple[float, str]], float]:
    """Runs ``tfposeidon-run -np 2 --mpi-args=--tag-output python diverge.py ARGS``; returns
    its exit status, each line of its output (stderr merged) with the monotonic time it
    arrived here, and the time the job ended. Kills the job after JOB_LIMIT_S."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tf_poseidon.launcher", "-np", "2", "--mpi-args=--tag-output",
         sys.executable, os.path.join(WORKERS, "diverge.py"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=job_env(),
        cwd=tempfile.gettempdir())
    lines = []

    def read():
        for raw in process.stdout:
            lines.append((time.monotonic(), raw.decode("utf-8", errors="replace").rstrip("\n")))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        status = process.wait(timeout=JOB_LIMIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        status = process.wait()
    ended = time.monotonic()
    reader.join(timeout=10)
    return status, lines, ended


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_diverging_ranks_end_the_job_naming_both_sides_on_every_rank(scenario, tmp_path):
    status, lines, ended = run_tagged(scenario, str(tmp_path))
    output = "\n".join(line for _, line in lines)
    assert status != 0, output[-3000:]
    assert "rank 0 finished" not in output, output[-3000:]
    diverged = min(t for t, line in lines if re.fullmatch(r"\[1,\d\]<stdout>: ?DIVERGE", line))
    for rank in (0, 1):
        # Open MPI's tag says which process printed the line; the line, which rank it is.
        # Each rank prints the error when it finds it, before any rank raises it and aborts.
        reports = [(t, line) for t, line in lines
                   if line.startswith(f"[1,{rank}]<stderr>: [tf_poseidon rank {rank}] ")
                   and all(re.search(p, line) for p in SCENARIOS[scenario])]
        assert reports, f"rank {rank} did not report it:\n{output[-4000:]}"
        seconds = reports[0][0] - diverged
        assert seconds < REPORT_BOUND_S, f"rank {rank} reported it {seconds:.1f} s after " \
                                         f"the ranks diverged:\n{output[-4000:]}"
        print(f"{scenario}: rank {rank} reported it {seconds:.1f} s after the divergence")
    assert ended - diverged < END_BOUND_S, f"{ended - diverged:.1f} s after the divergence"
    print(f"{scenario}: the job ended {ended - diverged:.1f} s after the divergence")
