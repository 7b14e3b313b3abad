"""The engine posts buckets in one canonical order on every rank, whatever order they are handed
over in: group instances in the order their first bucket arrived, buckets of an instance in
index order. Real CommEngine objects, one per rank, on the in-process loopback communicator."""

import time

import numpy as np
import pytest

from tf_poseidon.comm.buckets import Bucket, Item
from tf_poseidon.comm.codecs import Exact
from tf_poseidon.comm.engine import CollectiveGroup, CommEngine
from tf_poseidon.comm.protocol import AllReduce
from tf_poseidon.testing.loopback import LoopbackWorld

# Distinct sizes: buckets posted out of turn would meet a bucket of another size on another
# rank, which the loopback refuses.
BUCKET_SIZES = {"gradients": (3, 5, 7, 11), "metrics": (2,), "user": (13, 0, 1)}
INSTANCES = [("gradients", 0), ("metrics", 0), ("gradients", 1), ("user", 0), ("metrics", 1),
             ("gradients", 2), ("user", 1), ("gradients", 3)]
TIMEOUT_S = 20


def make_group(name):
    items = [Item(f"{name}/{i}", (n,), np.dtype(np.float32), n)
             for i, n in enumerate(BUCKET_SIZES[name])]
    buckets = [Bucket(i, "allreduce", (i,), (item,), item.payload_dtype)
               for i, item in enumerate(items)]
    return CollectiveGroup(name, buckets, {"allreduce": AllReduce(Exact())})


def payload(rank, name, instance, index):
    value = 1000 * rank + 100 * list(BUCKET_SIZES).index(name) + 10 * instance + index
    return np.full(BUCKET_SIZES[name][index], value, np.float32)


def handover_order(rng):
    """Every (group, instance, bucket) once, shuffled as TensorFlow's threads may hand them
    over: instances open in INSTANCES' order (an instance's first bucket, whichever it is,
    after the previous instance's first one), and bucket b of a group's instance k+1 comes
    after bucket b of its instance k; otherwise anything goes (later instances' buckets
    overtake earlier ones')."""
    pending = [(name, k, b) for name, k in INSTANCES for b in range(len(BUCKET_SIZES[name]))]
    next_instance = {(name, b): 0 for name in BUCKET_SIZES
                     for b in range(len(BUCKET_SIZES[name]))}
    opened, order = 0, []
    while pending:
        candidates = [job for job in pending if next_instance[job[0], job[2]] == job[1]
                      and INSTANCES.index(job[:2]) <= opened]
        job = candidates[rng.integers(len(candidates))]
        opened += INSTANCES.index(job[:2]) == opened
        next_instance[job[0], job[2]] += 1
        pending.remove(job)
        order.append(job)
    return order


@pytest.mark.parametrize("size", [2, 3, 4])
def test_out_of_order_handovers_are_posted_in_one_order_with_correct_sums(size):
    orders = [handover_order(np.random.default_rng(rank)) for rank in range(size)]
    canonical = [(name, k, b) for name, k in INSTANCES for b in range(len(BUCKET_SIZES[name]))]
    assert len({tuple(o) for o in orders + [canonical]}) == size + 1  # all differ

    def rank_main(comm):
        engine = CommEngine(comm)
        groups = {name: make_group(name) for name in BUCKET_SIZES}
        jitter = np.random.default_rng(100 + comm.rank)
        for name, instance, index in orders[comm.rank]:
            engine.submit(groups[name], index, payload(comm.rank, name, instance, index))
            if jitter.random() < 0.3:  # let the engine run part of the way now and then
                time.sleep(0.001)
        results = {(name, k, b): groups[name].wait_result(b, TIMEOUT_S) for name, k, b in
                   canonical}
        posted = [(r.group, r.instance, r.index) for r in engine.stats.records()]
        return results, posted

    for results, posted in LoopbackWorld(size, timeout_s=TIMEOUT_S).run(rank_main):
        assert posted == canonical
        for (name, k, b), result in results.items():
            np.testing.assert_array_equal(
                result, sum(payload(p, name, k, b) for p in range(size)))


def test_a_bucket_whose_ranks_disagree_fails_on_every_rank_with_a_clear_error():
    def rank_main(comm):
        engine = CommEngine(comm)
        group = make_group("metrics")
        engine.submit(group, 0, np.zeros(2 + comm.rank, np.float32))  # sizes differ by rank
        with pytest.raises(RuntimeError, match=r"collective 'metrics' bucket 0 failed on rank "
                                               rf"{comm.rank}.*count, dtype"):
            group.wait_result(0, TIMEOUT_S)

    start = time.monotonic()
    LoopbackWorld(2, timeout_s=TIMEOUT_S).run(rank_main)
    assert time.monotonic() - start < 5
