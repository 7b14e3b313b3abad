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
import time
from typing import Any, Callable

import numpy as np


def _mpi():
    from mpi4py import MPI
    return MPI


@dataclasses.dataclass(frozen=True)
class Collective:
    """``sum_into``, for collectives that sum: ``sum_into(comm, payload, out)`` writes the sum
    into ``out`` (same size and dtype) and leaves ``payload`` as it is, unless ``out`` is
    ``payload``, which is what ``run`` does. SSP keeps its own contribution this way."""

    name: str
    run: Callable[[Any, np.ndarray], np.ndarray]
    wire_bytes: Callable[[int, int], tuple[float, float]]
    sum_into: Callable[[Any, np.ndarray, np.ndarray], np.ndarray] | None = None


def as_mpi_buffer(array: np.ndarray) -> np.ndarray:
    """``array`` in a form mpi4py can send or receive into, for moving data (no arithmetic):
    a bfloat16 array, which mpi4py cannot buffer (not a DLPack type), as a uint16 view of its
    bits; any other array as it is."""
    return array.view(np.uint16) if array.dtype.name == "bfloat16" else array


def _ring_allreduce_bytes(payload_bytes: int, size: int) -> tuple[float, float]:
    moved = 2 * (size - 1) / size * payload_bytes
    return moved, moved


def _allreduce_sum_into(comm, payload: np.ndarray, out: np.ndarray) -> np.ndarray:
    comm.Allreduce(_mpi().IN_PLACE if out is payload else payload, out, op=_mpi().SUM)
    return out


def summing(name: str, sum_into: Callable[[Any, np.ndarray, np.ndarray], np.ndarray],
            wire_bytes: Callable[[int, int], tuple[float, float]]) -> Collective:
    """A Collective that sums through ``sum_into``: its ``run`` sums the payload in place."""
    return Collective(name, lambda comm, payload: sum_into(comm, payload, payload), wire_bytes,
                      sum_into)


ALLREDUCE_SUM = summing("allreduce_sum", _allreduce_sum_into, _ring_allreduce_bytes)
"""Sums the 1-D payload over all ranks, in place, in its own dtype (ring: 2(P-1)/P·n each way)."""


def _allgather_concat(comm, payload: np.ndarray) -> np.ndarray:
    counts = np.array(comm.allgather(payload.size), dtype=np.int64)
    out = np.empty(int(counts.sum()), payload.dtype)
    displacements = np.concatenate([[0], np.cumsum(counts)[:-1]])
    comm.Allgatherv(as_mpi_buffer(payload), [as_mpi_buffer(out), (counts, displacements)])
    return out


ALLGATHER_CONCAT = Collective(
    "allgather_concat", _allgather_concat,
    lambda payload_bytes, size: ((size - 1) * payload_bytes, (size - 1) * payload_bytes))
"""Every rank's 1-D payload concatenated in rank order; lengths may differ by rank (the bytes
reported assume equal lengths)."""


def min_over_ranks(comm, value: int) -> int:
    """The minimum of ``value`` over all ranks, on every rank (a blocking, tiny all-reduce)."""
    return int(comm.allreduce(int(value), op=_mpi().MIN))


class YieldingComm:
    """A communicator whose collectives wait by polling with short sleeps, not MPI's spinning.

    Wraps an mpi4py communicator; ``Allreduce``, ``Alltoall`` and ``Allgather`` (the calls the
    summing collectives make) and ``Sendrecv`` post the non-blocking form and poll it,
    sleeping 20 µs at first and up to 0.5 ms between polls. Open MPI's blocking waits spin a
    core at 100 %; where TensorFlow's compute needs every core, a collective that nobody waits
    for yet (SSP's delta exchange) then takes a core from the step for as long as the slowest
    peer needs to join. Costs up to 0.5 ms of latency per call: not for collectives a step
    waits on. Blocking, like the calls it replaces; engine thread only.
    """

    FIRST_SLEEP_S = 2e-5
    LONGEST_SLEEP_S = 5e-4

    def __init__(self, comm):
        self._comm = comm

    def Get_size(self) -> int:
        return self._comm.Get_size()

    def Get_rank(self) -> int:
        return self._comm.Get_rank()

    def Allreduce(self, sendbuf, recvbuf, op=None) -> None:
        self._wait(self._comm.Iallreduce(sendbuf, recvbuf, op=op or _mpi().SUM))

    def Alltoall(self, sendbuf, recvbuf) -> None:
        self._wait(self._comm.Ialltoall(sendbuf, recvbuf))

    def Allgather(self, sendbuf, recvbuf) -> None:
        self._wait(self._comm.Iallgather(sendbuf, recvbuf))

    def Sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        self._wait(self._comm.Irecv(recvbuf, source=source, tag=tag),
                   self._comm.Isend(sendbuf, dest=dest, tag=tag))

    def _wait(self, *requests) -> None:
        sleep = self.FIRST_SLEEP_S
        while not _mpi().Request.Testall(list(requests)):
            time.sleep(sleep)
            sleep = min(2 * sleep, self.LONGEST_SLEEP_S)
