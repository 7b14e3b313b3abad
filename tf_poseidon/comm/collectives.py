"""What the engine runs for one bucket: ``(comm, bucket_index, payload) -> result``.

Each function runs on the engine thread only, with the process's communicator, and is a
collective: every rank runs it for the same bucket in the same order (engine.py guarantees it).
mpi4py is imported here lazily, because importing it initialises MPI, which a world of one
process never does.
"""

from __future__ import annotations

import numpy as np


def _mpi():
    from mpi4py import MPI
    return MPI


def allreduce_sum(comm, index: int, payload: np.ndarray) -> np.ndarray:
    """Sums ``payload`` (1-D) over all ranks, in place, in its own dtype. Returns it."""
    del index
    comm.Allreduce(_mpi().IN_PLACE, payload, op=_mpi().SUM)
    return payload


def allgather_concat(comm, index: int, payload: np.ndarray) -> np.ndarray:
    """Concatenates every rank's 1-D ``payload`` in rank order; lengths may differ by rank."""
    del index
    counts = np.array(comm.allgather(payload.size), dtype=np.int64)
    out = np.empty(int(counts.sum()), payload.dtype)
    displacements = np.concatenate([[0], np.cumsum(counts)[:-1]])
    comm.Allgatherv(payload, [out, (counts, displacements)])
    return out


def min_over_ranks(comm, value: int) -> int:
    """The minimum of ``value`` over all ranks, on every rank (a blocking, tiny all-reduce)."""
    return int(comm.allreduce(int(value), op=_mpi().MIN))
