"""The in-process communicator (tf_poseidon/testing/loopback.py) keeps MPI's semantics: every
rank gets the same result, gathers are in rank order, requests complete on Test or Wait, and bad
use (mismatched calls, a missing peer, a failing rank) raises on every rank instead of hanging."""

import time

import ml_dtypes
import numpy as np
import pytest

from tf_poseidon.comm import collectives
from tf_poseidon.testing.loopback import MPI, LoopbackError, LoopbackTimeoutError, LoopbackWorld


def values(rank, size=5, dtype=np.float32):
    return (np.arange(size) * 10 + rank + 1).astype(dtype)


@pytest.mark.parametrize("op, reduce", [(MPI.SUM, np.sum), (MPI.MAX, np.max),
                                        (MPI.MIN, np.min), (MPI.PROD, np.prod)])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_allreduce_same_result_on_every_rank_also_in_place(op, reduce, size):
    def rank_main(comm):
        out = np.empty(5, np.float64)
        comm.Allreduce(values(comm.rank, dtype=np.float64), out, op=op)
        in_place = values(comm.rank, dtype=np.float64)
        comm.Allreduce(MPI.IN_PLACE, in_place, op=op)
        nonblocking = np.empty(5)
        comm.Iallreduce(values(comm.rank, dtype=np.float64), nonblocking, op=op).Wait()
        return out, in_place, nonblocking

    expected = reduce([values(r, dtype=np.float64) for r in range(size)], axis=0)
    for results in LoopbackWorld(size).run(rank_main):
        for result in results:
            np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_gathers_and_alltoall_are_in_rank_order(size):
    def rank_main(comm):
        mine = values(comm.rank, 3)
        gathered = np.empty(3 * size, np.float32)
        comm.Allgather(mine, gathered)
        uneven = np.full(comm.rank, comm.rank, np.int64)  # rank r sends r values
        counts = np.arange(size)
        gatheredv = np.full(counts.sum() + 1, -1, np.int64)  # one element more than needed
        comm.Allgatherv(uneven, [gatheredv, (counts, np.concatenate([[0], np.cumsum(counts)
                                                                    [:-1]]))])
        blocks = np.array([100 * comm.rank + q for q in range(size)], np.int32)
        exchanged = np.empty(size, np.int32)
        comm.Alltoall(blocks, exchanged)
        broadcast = np.array([comm.rank], np.int32)
        comm.Bcast(broadcast, root=size - 1)
        return gathered, gatheredv, exchanged, broadcast, comm.allgather({"rank": comm.rank})

    for rank, (gathered, gatheredv, exchanged, broadcast, objects) in enumerate(
            LoopbackWorld(size).run(rank_main)):
        np.testing.assert_array_equal(gathered, np.concatenate([values(r, 3)
                                                                for r in range(size)]))
        assert gatheredv.tolist() == [r for r in range(size) for _ in range(r)] + [-1]
        assert exchanged.tolist() == [100 * q + rank for q in range(size)]
        assert broadcast.tolist() == [size - 1]
        assert objects == [{"rank": r} for r in range(size)]


def test_python_objects_are_copies_reduced_in_rank_order():
    def rank_main(comm):
        mine = [comm.rank]
        summed = comm.allreduce(mine)  # list + list: rank order shows
        root_value = comm.bcast({"from": comm.rank} if comm.rank == 1 else None, root=1)
        return mine, summed, root_value, comm.allreduce(comm.rank, op=MPI.MAX)

    for mine, summed, root_value, largest in LoopbackWorld(3).run(rank_main):
        assert summed == [0, 1, 2] and summed is not mine
        assert root_value == {"from": 1} and largest == 2


def test_nonblocking_requests_complete_on_test_or_wait_and_fill_the_buffer_then():
    def rank_main(comm):
        out = np.zeros(2, np.float32)
        request = comm.Ialltoall(np.full(2, comm.rank + 1, np.float32), out)
        if comm.rank == 0:
            polls = 0
            while not request.Test():
                polls += 1
                time.sleep(0.001)
            assert polls > 0  # rank 1 joined late
        else:
            time.sleep(0.05)
            request.Wait()
        return out

    for out in LoopbackWorld(2).run(rank_main):
        assert out.tolist() == [1, 2]


def test_point_to_point_matches_source_and_tag_in_sending_order():
    def rank_main(comm):
        peer = 1 - comm.rank
        first, second = np.empty(2, np.int64), np.empty(2, np.int64)
        receives = [comm.Irecv(second, source=peer, tag=8), comm.Irecv(first, source=peer, tag=7)]
        sends = [comm.Isend(np.array([comm.rank, t], np.int64), dest=peer, tag=t)
                 for t in (7, 8)]
        while not type(receives[0]).Testall(receives + sends):
            time.sleep(0.001)
        swapped = np.empty(1, np.float32)
        comm.Sendrecv(np.array([comm.rank], np.float32), dest=peer, recvbuf=swapped, source=peer)
        return first.tolist(), second.tolist(), swapped.tolist()

    for rank, (first, second, swapped) in enumerate(LoopbackWorld(2).run(rank_main)):
        assert first == [1 - rank, 7] and second == [1 - rank, 8] and swapped == [1 - rank]


def test_yielding_comm_waits_on_the_loopbacks_requests():
    def rank_main(comm):
        yielding = collectives.YieldingComm(comm)
        summed = np.empty(3, np.float32)
        yielding.Allreduce(np.full(3, comm.rank + 1, np.float32), summed)
        peer = 1 - comm.rank
        swapped = np.empty(3, np.float32)
        mine = summed * (comm.rank + 1)
        yielding.wait(comm.Irecv(swapped, source=peer, tag=5), comm.Isend(mine, dest=peer, tag=5))
        return summed, swapped

    (sum0, swap0), (sum1, swap1) = LoopbackWorld(2).run(rank_main)
    assert sum0.tolist() == sum1.tolist() == [3, 3, 3]
    assert swap0.tolist() == [6, 6, 6] and swap1.tolist() == [3, 3, 3]


@pytest.mark.parametrize("mismatch, message", [
    (lambda comm: comm.Allreduce(np.zeros(3 + comm.rank), np.empty(3 + comm.rank)),
     "count, dtype"),
    (lambda comm: comm.Allreduce(np.zeros(3, [np.float32, np.float64][comm.rank]),
                                 np.empty(3, [np.float32, np.float64][comm.rank])),
     "count, dtype"),
    (lambda comm: comm.Allreduce(np.zeros(3), np.empty(3), op=[MPI.SUM, MPI.MAX][comm.rank]),
     "reduction"),
    (lambda comm: comm.Allgather(np.zeros(2 + comm.rank), np.empty(2 * (2 + comm.rank))),
     "bytes sent"),
    (lambda comm: comm.Allgatherv(np.zeros(2 + comm.rank), [np.empty(5), [2, 2 + comm.rank]]),
     "receive counts"),
    (lambda comm: comm.Bcast(np.zeros(2), root=comm.rank), "root"),
    (lambda comm: comm.Allreduce(np.zeros(2), np.empty(2)) if comm.rank == 0 else
     comm.Allgather(np.zeros(1), np.empty(2)), "every rank must make the same collective"),
    (lambda comm: comm.Allreduce(np.zeros(2), np.empty(2)) if comm.rank == 0 else
     comm.Iallreduce(np.zeros(2), np.empty(2)).Wait(), "every rank must make the same"),
])
def test_a_mismatch_raises_on_every_rank_instead_of_hanging(mismatch, message):
    errors = []

    def rank_main(comm):
        try:
            mismatch(comm)
        except LoopbackError as e:
            errors.append(str(e))
            raise
    start = time.monotonic()
    with pytest.raises(LoopbackError, match=message):
        LoopbackWorld(2, timeout_s=30).run(rank_main)
    assert time.monotonic() - start < 5  # raised at once, not after the timeout
    assert len(errors) == 2 and all(message in e for e in errors)


def test_a_missing_peer_or_message_times_out_naming_it():
    with pytest.raises(LoopbackTimeoutError, match=r"Barrier.*rank\(s\) \[0\]"):
        LoopbackWorld(2, timeout_s=0.3).run(lambda comm: comm.rank == 1 and comm.Barrier())
    with pytest.raises(LoopbackTimeoutError, match="Irecv from rank 1 .tag 3"):
        LoopbackWorld(2, timeout_s=0.3).run(
            lambda comm: comm.rank == 0 and comm.Irecv(np.empty(1), source=1, tag=3).Wait())
    request_world = LoopbackWorld(2, timeout_s=0.3)
    request = request_world.comm(0).Iallgather(np.zeros(1), np.empty(2))
    with pytest.raises(LoopbackTimeoutError, match="Iallgather"):  # polling with Test ends
        while not request.Test():
            time.sleep(0.01)


def test_a_failing_rank_aborts_the_others_waits():
    def rank_main(comm):
        if comm.rank == 2:
            raise ValueError("rank 2 broke")
        comm.Barrier()

    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 2 broke"):
        LoopbackWorld(3, timeout_s=30).run(rank_main)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("call, error, message", [
    (lambda comm: comm.Allreduce(np.zeros(2, ml_dtypes.bfloat16),
                                 np.empty(2, ml_dtypes.bfloat16)), TypeError, "uint16"),
    (lambda comm: comm.Allreduce([1.0], np.empty(1)), TypeError, "numpy arrays"),
    (lambda comm: comm.Allreduce(np.zeros(2), np.empty(3)), ValueError, "differ"),
    (lambda comm: comm.Alltoall(np.zeros(3, np.uint8), np.empty(3, np.uint8)), ValueError,
     "split into 2"),
    (lambda comm: comm.Irecv(np.empty(1), source=5), ValueError, "no rank 5"),
])
def test_bad_buffers_and_arguments_raise_on_the_calling_rank(call, error, message):
    with pytest.raises(error, match=message):
        call(LoopbackWorld(2, timeout_s=1).comm(0))


def test_a_message_longer_than_the_buffer_raises():
    def rank_main(comm):
        if comm.rank == 0:
            comm.Isend(np.zeros(4), dest=1)
        else:
            comm.Irecv(np.empty(2), source=0).Wait()

    with pytest.raises(LoopbackError, match="does not fit"):
        LoopbackWorld(2).run(rank_main)
