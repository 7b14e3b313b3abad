"""SSP's bookkeeping (algorithms/ssp.py: _DeltaExchange) in this process: P ranks as threads, each
with a real CommEngine on the loopback communicator, drive the exchange eagerly as a train step
does (the base taken before the update, the batch's exchange after it, the drain at the end),
ranks running at uneven speeds.

After every step, each rank's variables must hold every rank's averaged update of each step its
exchange has applied, and its own full update of each later step — with the steps applied
reaching at least t−s+1 at step t (the staleness bound) — and after the drain every rank must
hold W_0 + Σ_t R(t): every update applied exactly once.
"""

import functools
import time

import numpy as np
import pytest
import tensorflow as tf

from tf_poseidon.algorithms import ssp
from tf_poseidon.algorithms.ssp import SSPStats, _DeltaExchange
from tf_poseidon.comm import codecs
from tf_poseidon.comm.buckets import plan_buckets
from tf_poseidon.comm.engine import CommEngine
from tf_poseidon.comm.graph_ops import Sequencer
from tf_poseidon.testing.loopback import LoopbackWorld

STEPS = 9
SHAPES = [((3, 4), np.float32), ((5,), np.float32), ((2, 3), np.float64), ((7,), np.float32)]
TIMEOUT_S = 30


def deltas(num_ranks):
    """Δ_p(t) per rank, step and variable: what each rank's optimizer does to its variables."""
    rng = np.random.default_rng(num_ranks)
    return [[[(rng.normal(size=shape) * 0.01).astype(dtype) for shape, dtype in SHAPES]
             for _ in range(STEPS)] for _ in range(num_ranks)]


def fresh_codec(name):
    """A codec of the rank's own (the 16-bit codecs keep wire buffers between calls)."""
    return codecs.Exact() if name == "none" else codecs.HalfPrecision(
        "fp16", np.dtype(np.float16), scaled=True)


def run_rank(comm, staleness, codec_name, updates, initial):
    """One rank's steps; returns its variables after each step and after the drain, the steps
    applied after each step, and its lateness histogram."""
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    engine = CommEngine(comm)
    variables = [tf.Variable(value) for value in initial]
    plan = functools.partial(plan_buckets, bucket_bytes=64, first_bucket_bytes=32)
    stats = SSPStats()
    exchange = _DeltaExchange("ssp_deltas", fresh_codec(codec_name), variables, plan, staleness,
                              num_replicas=num_ranks, stats=stats)
    assert len(exchange.plan) > 1
    jitter = np.random.default_rng(rank)
    history, applied = [], []
    sequencer = Sequencer()
    for step in range(STEPS):
        exchange.before_update()
        for variable, delta in zip(variables, updates[rank][step]):
            variable.assign_add(delta)  # the optimizer's update, from the local gradient
        exchange.after_update(engine, sequencer)
        history.append([v.numpy() for v in variables])
        applied.append([exchange._applied[b.index] for b in exchange.plan])
        if jitter.random() < 0.5:  # ranks run at uneven speeds
            time.sleep(jitter.uniform(0, 0.01) * (1 + 3 * (rank == 0)))
    exchange.drain(engine, sequencer)
    return history, applied, [v.numpy() for v in variables], exchange.plan, stats.lateness


@pytest.mark.parametrize("codec_name", ["none", "fp16"])
@pytest.mark.parametrize("staleness", [1, 2, 3, 4])
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_every_update_is_applied_once_within_the_staleness_bound(monkeypatch, num_ranks,
                                                                 staleness, codec_name):
    monkeypatch.setenv("TF_POSEIDON_TIMEOUT", str(TIMEOUT_S))
    # Chunks of one or two elements: the engine's pipeline runs more chunks than its depth,
    # and a short last one.
    monkeypatch.setattr(ssp, "CHUNK_BYTES", 8)
    updates = deltas(num_ranks)
    initial = [np.full(shape, 1.0, dtype) for shape, dtype in SHAPES]
    averaged = [[np.mean([updates[p][t][i].astype(np.float64) for p in range(num_ranks)], axis=0)
                 for i in range(len(SHAPES))] for t in range(STEPS)]
    # float32 values near 1 take up to three roundings a step (update, refresh: an ulp each at
    # most); fp16 also rounds each step's averaged update to 11 bits of the bucket's largest
    # share (~0.03).
    tolerance = STEPS * (3 * 2.0 ** -23 + (0 if codec_name == "none" else 2.0 ** -10 * 0.03))
    world = LoopbackWorld(num_ranks, timeout_s=TIMEOUT_S)
    results = world.run(lambda comm: run_rank(comm, staleness, codec_name, updates, initial))

    for rank, (history, applied, final, plan, lateness) in enumerate(results):
        for step in range(STEPS):
            for bucket, steps_applied in zip(plan, applied[step]):
                assert step - staleness + 1 <= steps_applied <= step + 1, (rank, step)
                for i in bucket.members:
                    expected = initial[i] + sum(averaged[t][i] for t in range(steps_applied)) + \
                        sum(updates[rank][t][i] for t in range(steps_applied, step + 1))
                    np.testing.assert_allclose(history[step][i], expected, rtol=0,
                                               atol=tolerance, err_msg=f"rank {rank} step {step}")
        for i, value in enumerate(final):
            np.testing.assert_allclose(value, initial[i] + sum(a[i] for a in averaged), rtol=0,
                                       atol=tolerance, err_msg=f"rank {rank} after the drain")
        assert sum(lateness.values()) == STEPS  # bucket 0: each step's update taken once
        assert max(lateness) <= staleness and min(lateness) >= 0
    for _, _, final, _, _ in results[1:]:  # replicas agree up to summation order
        for mine, first in zip(final, results[0][2]):
            np.testing.assert_allclose(mine, first, rtol=0, atol=tolerance)
