"""MPI primitives the bucket protocols, codecs and control-plane calls are built from.

Every function here is called on the engine thread only (comm/engine.py), with the process's
communicator, and is a collective: every rank calls it for the same bucket in the same order
(the engine guarantees that). All of them block until done. mpi4py is imported lazily, because
importing it initialises MPI, which a world of one process never does.
"""

from __future__ import annotations

import time

import numpy as np


def mpi():
    """The mpi4py ``MPI`` module (initialises MPI on first use)."""
    from mpi4py import MPI
    return MPI


def as_mpi_buffer(array: np.ndarray) -> np.ndarray:
    """``array`` in a form mpi4py can send or receive into, for moving data (no arithmetic):
    a bfloat16 array, which mpi4py cannot buffer (not a DLPack type), as a uint16 view of its
    bits; any other array as it is."""
    return array.view(np.uint16) if array.dtype.name == "bfloat16" else array


def allreduce_sum_into(comm, payload: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The sum over ranks of the 1-D ``payload`` into ``out`` (same size and dtype; may be
    ``payload``: in place), in the payload's own dtype; returns ``out``."""
    comm.Allreduce(mpi().IN_PLACE if out is payload else payload, out, op=mpi().SUM)
    return out


def allgather_concat(comm, payload: np.ndarray) -> np.ndarray:
    """Every rank's 1-D ``payload`` concatenated in rank order (a new array); lengths may
    differ by rank."""
    counts = np.array(comm.allgather(payload.size), dtype=np.int64)
    out = np.empty(int(counts.sum()), payload.dtype)
    displacements = np.concatenate([[0], np.cumsum(counts)[:-1]])
    comm.Allgatherv(as_mpi_buffer(payload), [as_mpi_buffer(out), (counts, displacements)])
    return out


def min_over_ranks(comm, value: int) -> int:
    """The minimum of ``value`` over all ranks, on every rank (a tiny all-reduce)."""
    return int(comm.allreduce(int(value), op=mpi().MIN))


class YieldingComm:
    """A communicator whose collectives wait by polling with short sleeps, not MPI's spinning.

    Wraps an mpi4py communicator; ``Allreduce``, ``Alltoall`` and ``Allgather`` (the calls the
    codecs' sums make) post the non-blocking form and poll it (``wait``, also for requests
    posted on ``comm`` directly), sleeping 20 µs at first and up to 0.5 ms between polls. Open
    MPI's blocking waits spin a core at 100 %; where TensorFlow's compute needs every core, a
    collective that nobody waits for yet (SSP's delta exchange) then takes a core from the step
    for as long as the slowest peer needs to join. Costs up to 0.5 ms of latency per call: not
    for collectives a step waits on. Blocking, like the calls it replaces; engine thread only.
    """

    FIRST_SLEEP_S = 2e-5
    LONGEST_SLEEP_S = 5e-4

    def __init__(self, comm):
        self.comm = comm  # the wrapped communicator, for posting non-blocking calls

    def Get_size(self) -> int:
        return self.comm.Get_size()

    def Get_rank(self) -> int:
        return self.comm.Get_rank()

    def Allreduce(self, sendbuf, recvbuf, op=None) -> None:
        self.wait(self.comm.Iallreduce(sendbuf, recvbuf, op=op or mpi().SUM))

    def Alltoall(self, sendbuf, recvbuf) -> None:
        self.wait(self.comm.Ialltoall(sendbuf, recvbuf))

    def Allgather(self, sendbuf, recvbuf) -> None:
        self.wait(self.comm.Iallgather(sendbuf, recvbuf))

    def wait(self, *requests) -> None:
        """Polls ``requests`` (of the wrapped communicator) until all are complete."""
        # The requests' own class tests them: mpi4py's MPI.Request, or, in tests, the in-process
        # communicator's (tf_poseidon/testing/loopback.py).
        test_all = type(requests[0]).Testall
        sleep = self.FIRST_SLEEP_S
        while not test_all(list(requests)):
            time.sleep(sleep)
            sleep = min(2 * sleep, self.LONGEST_SLEEP_S)
