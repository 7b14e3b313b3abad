"""Collectives the engine runs on a bucket, each with what it puts on the wire.

A :class:`Collective` is the unit a synchronizer plugs into the engine (PyTorch DDP's "comm
hook"): ``run(comm, payload) -> result`` is called on the engine thread only, with the process's
communicator, and is a collective — every rank runs it for the same bucket in the same order
(engine.py guarantees that). ``wire_bytes(payload_bytes, P) -> (sent, received)`` is what one
rank sends and receives for it, by the algorithm's formula (MPI may pick another algorithm; the
formula is what the statistics report). mpi4py is imported lazily, because importing it
initialises MPI, which a world of one process never does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np


def _mpi():
    from mpi4py import MPI
    return MPI


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str
    run: Callable[[Any, np.ndarray], np.ndarray]
    wire_bytes: Callable[[int, int], tuple[float, float]]


def _ring_allreduce_bytes(payload_bytes: int, size: int) -> tuple[float, float]:
    moved = 2 * (size - 1) / size * payload_bytes
    return moved, moved


def _allreduce_sum(comm, payload: np.ndarray) -> np.ndarray:
    comm.Allreduce(_mpi().IN_PLACE, payload, op=_mpi().SUM)
    return payload


ALLREDUCE_SUM = Collective(
    "allreduce_sum", _allreduce_sum, _ring_allreduce_bytes)
"""Sums the 1-D payload over all ranks, in place, in its own dtype (ring: 2(P-1)/P·n each way)."""


def _allgather_concat(comm, payload: np.ndarray) -> np.ndarray:
    counts = np.array(comm.allgather(payload.size), dtype=np.int64)
    out = np.empty(int(counts.sum()), payload.dtype)
    displacements = np.concatenate([[0], np.cumsum(counts)[:-1]])
    comm.Allgatherv(payload, [out, (counts, displacements)])
    return out


ALLGATHER_CONCAT = Collective(
    "allgather_concat", _allgather_concat,
    lambda payload_bytes, size: ((size - 1) * payload_bytes, (size - 1) * payload_bytes))
"""Every rank's 1-D payload concatenated in rank order; lengths may differ by rank (the bytes
reported assume equal lengths)."""


def min_over_ranks(comm, value: int) -> int:
    """The minimum of ``value`` over all ranks, on every rank (a blocking, tiny all-reduce)."""
    return int(comm.allreduce(int(value), op=_mpi().MIN))
