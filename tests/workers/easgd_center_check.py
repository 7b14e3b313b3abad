"""Worker for tests/test_easgd.py: the async EASGD center protocol alone (no TensorFlow ops),
P ≥ 2.

    tfposeidon-run -np 3 python tests/workers/easgd_center_check.py

Chunks are made tiny (64 bytes), so vectors travel in many chunks (float32, float64 and
bfloat16 — which mpi4py cannot buffer itself —, lengths that are not multiples of the chunk).
Group 0: every rank ≠ 0 exchanges with the holder on rank 0 while rank 0 exchanges locally
(they interleave); the center only ever moves by the d's it hands out, so c_final = c_0 + Σ d
over all exchanges, which rank 0 checks. Groups 1 (float64) and 2 (bfloat16): only rank 1
exchanges, so it checks every reply exactly (d = α(x − c), c ← c + d); rank 0 registers them
only after rank 1 has sent its first exchange for them (which waits, unmatched).
Prints "CENTER OK rank <r>" on every rank that passed.
"""

import time

import numpy as np
import tensorflow as tf

from tf_poseidon import world
from tf_poseidon.algorithms import easgd_center

ALPHA = 0.25
BFLOAT16 = tf.bfloat16.as_numpy_dtype
SIZES = {0: (1000, np.float32), 1: (37, np.float64), 2: (45, BFLOAT16)}
EXACT = (1, 2)  # the groups only rank 1 exchanges
EXCHANGES = 5


def initial(group):
    n, dtype = SIZES[group]
    return (np.arange(n) * 0.5 - 3).astype(dtype)


def x_for(rank, group, k):
    n, dtype = SIZES[group]
    return (np.sin(np.arange(n) + 10 * rank + k) * (k + 1)).astype(dtype)


def main():
    easgd_center.CHUNK_BYTES = 64
    engine_comm = world.mpi_comm()
    comm = engine_comm.Dup()
    rank, size = engine_comm.Get_rank(), engine_comm.Get_size()
    moved = {g: np.zeros(SIZES[g][0], np.float64) for g in SIZES}  # Σ d this rank received
    if rank == 0:
        holder = easgd_center.CenterHolder(comm, ALPHA)
        holder.register(0, initial(0))
        engine_comm.Barrier()  # the workers start exchanging group 0 (and send group 1)
        for k in range(EXCHANGES):
            moved[0] += holder.exchange(0, x_for(0, 0, k))
        time.sleep(0.5)        # ... while group 1 does not exist yet here
        for group in EXACT:
            holder.register(group, initial(group))
    else:
        client = easgd_center.CenterClient(comm)
        counters = easgd_center.ExchangeCounters()
        engine_comm.Barrier()
        centers = {g: initial(g) for g in EXACT}  # only rank 1 exchanges: it knows the center
        for k in range(EXCHANGES):
            for group in (0, *EXACT) if rank == 1 else (0,):
                x = x_for(rank, group, k)
                d = client.exchange(group, x, counters)
                assert d.dtype == x.dtype and d.shape == x.shape
                if group in EXACT:  # d = α(x − c), c ← c + d, in the center's dtype, exactly
                    expected = (x - centers[group]) * x.dtype.type(ALPHA)
                    np.testing.assert_array_equal(d, expected)
                    centers[group] = centers[group] + expected
                moved[group] += d.astype(np.float64)
        assert counters.exchanges == (1 + len(EXACT) if rank == 1 else 1) * EXCHANGES
    # Buffer (uppercase) calls only while exchanges may be in flight: mpi4py's pickle-based
    # collectives (comm.reduce, ...) keep the GIL while they wait, which would stop rank 0's
    # holder thread and so the very exchanges they wait for.
    engine_comm.Barrier()
    totals = {}
    for g in SIZES:
        totals[g] = np.zeros_like(moved[g])
        engine_comm.Reduce(moved[g], totals[g], root=0)
    if rank == 0:
        for g in SIZES:
            expected = initial(g).astype(np.float64) + totals[g]
            got = holder.snapshot(g)
            assert got.dtype == SIZES[g][1]
            # bfloat16 rounds the center at each of its EXCHANGES additions (ulp ≤ 2^-3 here).
            atol = EXCHANGES * 2.0 ** -3 if got.dtype == BFLOAT16 else 1e-4
            np.testing.assert_allclose(got.astype(np.float64), expected, rtol=1e-5, atol=atol)
        # group 0 by P−1 ranks, the exact groups by rank 1
        assert holder.served.exchanges == EXCHANGES * (size - 1 + len(EXACT))
        holder.close()
    engine_comm.Barrier()
    print(f"CENTER OK rank {rank}", flush=True)


if __name__ == "__main__":
    main()
