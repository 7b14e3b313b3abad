"""Ranks that post different collectives fail fast, on every rank, with both sides named.

Before every group of buckets and every control-plane call the ranks agree on what they post
(comm/agreement.py); before fit/evaluate/predict they agree on the data they were given. Each
scenario of tests/workers/diverge.py at P=2 must end non-zero within 30 s of the point where
the ranks go different ways, with the message that says what happened.
"""

import re
import time

import pytest

from multirank import run_job

pytestmark = pytest.mark.multirank

SCENARIOS = {
    "chief_evaluate": [r"rank 0 posted control-plane call 'input data'", r"rank 1 posted "
                       r"control-plane call 'end of program'", r"reached the end of its program",
                       r"if tp\.is_chief\(\)"],
    "callback": [r"rank 0 posted reduce", r"rank 1 posted gradients step \d+"],
    "terminate_on_nan": [r"ranks posted different collectives", r"rank 1 posted ssp_deltas",
                         r"TerminateOnNaN"],
    "lengths_steps": [r"the ranks were given different data \(rank 0: 4 batches of 32, the "
                      r"last of 4; rank 1: 5 batches of 32, the last of 2\)",
                      r"distribute_datasets_from_function"],
    "lengths_rows": [r"rank 0: 4 batches of 32, the last of 4; rank 1: 4 batches of 32, the "
                     r"last of 14"],
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_diverging_ranks_end_the_job_naming_both_sides(scenario):
    result, _ = run_job(2, "diverge.py", scenario, timeout=300)
    ended = time.time()
    output = result.stdout
    assert result.returncode != 0, output[-3000:]
    assert "rank 0 finished" not in output, output[-3000:]
    diverged = min(float(t) for t in re.findall(r"DIVERGE (\S+)", output))
    assert ended - diverged < 30, f"{ended - diverged:.1f} s after the ranks diverged"
    for pattern in SCENARIOS[scenario]:
        assert re.search(pattern, output), (pattern, output[-4000:])
