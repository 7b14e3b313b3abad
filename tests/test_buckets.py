"""Bucket planning: backprop order, caps, one dtype per bucket, every tensor exactly once."""

import numpy as np
import pytest
import tensorflow as tf

from tf_poseidon.comm.buckets import Item, member_slices, plan_buckets


def tensors(*specs):
    return [tf.zeros(shape, dtype) for shape, dtype in specs]


def test_last_tensor_goes_first_and_caps_hold():
    values = tensors(*[((1000,), tf.float32)] * 10)  # 4000 bytes each
    plan = plan_buckets(values, bucket_bytes=10000, first_bucket_bytes=4000)
    assert plan[0].members == (9,)
    assert [b.members for b in plan[1:]] == [(8, 7), (6, 5), (4, 3), (2, 1), (0,)]
    assert all(b.payload_bytes <= 10000 for b in plan)
    assert sorted(m for b in plan for m in b.members) == list(range(10))
    assert [b.index for b in plan] == list(range(len(plan)))


def test_oversized_tensor_gets_its_own_bucket():
    values = tensors(((10,), tf.float32), ((100000,), tf.float32), ((10,), tf.float32))
    plan = plan_buckets(values, bucket_bytes=1000, first_bucket_bytes=1000)
    assert (1,) in [b.members for b in plan]


def test_dtypes_are_never_mixed_and_16_bit_floats_sum_in_float32():
    values = tensors(((4,), tf.float32), ((4,), tf.float64), ((4,), tf.float16),
                     ((4,), tf.int32))
    plan = plan_buckets(values)
    by_member = {m: b.payload_dtype for b in plan for m in b.members}
    assert by_member == {0: np.float32, 1: np.float64, 2: np.float32, 3: np.int64}


def test_unknown_shapes_and_strings_are_refused():
    @tf.function(input_signature=[tf.TensorSpec([None, 3])])
    def plan_unknown(x):
        plan_buckets([x])
        return x

    with pytest.raises(ValueError, match="fully defined shape"):
        plan_unknown.get_concrete_function()
    with pytest.raises(TypeError, match="string"):
        plan_buckets([tf.constant(["a"])])


def test_member_slices_cut_the_payload_in_member_order():
    payload = np.arange(10)
    parts = member_slices((3, 0, 7))
    assert [payload[p].tolist() for p in parts] == [[0, 1, 2], [], list(range(3, 10))]
    assert member_slices(()) == []


def test_aligned_member_slices_start_each_member_on_a_tensor_boundary():
    # 64 bytes: 16 float32 or 8 float64 elements; a member's pieces of an aligned payload
    # then become tensors without a copy (SSP's corrections).
    assert member_slices((1000, 3, 16, 5), np.float32) == [
        slice(0, 1000), slice(1008, 1011), slice(1024, 1040), slice(1040, 1045)]
    assert member_slices((3, 2), np.float64) == [slice(0, 3), slice(8, 10)]


def items(specs):
    """Items of (kind, dtype, elements) specs, named by position."""
    return [Item(str(i), (n,), np.dtype(dtype), n, kind) for i, (kind, dtype, n) in
            enumerate(specs)]


def check_plan(entries, plan, bucket_bytes, first_bucket_bytes):
    """The planner's contract, for caps with first_bucket_bytes <= bucket_bytes."""
    assert [b.index for b in plan] == list(range(len(plan)))
    assert sorted(m for b in plan for m in b.members) == list(range(len(entries)))
    for bucket in plan:
        assert bucket.items == tuple(entries[m] for m in bucket.members)
        assert {(i.kind, i.payload_dtype) for i in bucket.items} == {
            (bucket.kind, bucket.payload_dtype)}  # one kind, one dtype
        assert list(bucket.members) == sorted(bucket.members, reverse=True)  # backprop order
        if len(bucket.members) > 1:  # only an item alone may exceed the cap
            cap = first_bucket_bytes if bucket.index == 0 else bucket_bytes
            assert bucket.payload_bytes <= cap, (bucket, cap)
    for key in {(b.kind, b.payload_dtype) for b in plan}:  # each stream in backprop order
        stream = [b for b in plan if (b.kind, b.payload_dtype) == key]
        for earlier, later in zip(stream, stream[1:]):
            assert min(earlier.members) > max(later.members)


def test_kinds_and_dtypes_are_never_mixed_in_interleaved_streams():
    entries = items([("allreduce", np.float32, 10), ("sfb", np.float32, 30),
                     ("allreduce", np.float64, 5), ("allreduce", np.float32, 10),
                     ("sfb", np.float32, 30), ("allreduce", np.int64, 1),
                     ("allreduce", np.float32, 10)])
    plan = plan_buckets(entries, bucket_bytes=1 << 20, first_bucket_bytes=1 << 20)
    assert sorted((b.kind, b.payload_dtype.name, b.members) for b in plan) == [
        ("allreduce", "float32", (6, 3, 0)), ("allreduce", "float64", (2,)),
        ("allreduce", "int64", (5,)), ("sfb", "float32", (4, 1))]
    check_plan(entries, plan, 1 << 20, 1 << 20)


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_keep_the_contract(seed):
    rng = np.random.default_rng(seed)
    kinds = ["allreduce", "sfb", "ssp_delta"][:rng.integers(1, 4)]
    dtypes = [np.float32, np.float64, np.int64][:rng.integers(1, 4)]
    entries = items([(kinds[rng.integers(len(kinds))], dtypes[rng.integers(len(dtypes))],
                      int(rng.choice([0, 1, rng.integers(1, 300), rng.integers(300, 3000)])))
                     for _ in range(rng.integers(0, 40))])
    first = int(rng.integers(1, 4000))
    cap = first + int(rng.integers(0, 8000))
    check_plan(entries, plan_buckets(entries, cap, first), cap, first)


def test_one_stream_closes_a_bucket_only_when_the_next_item_would_not_fit():
    sizes = [7, 3, 40, 1, 1, 25, 9, 0, 12, 30, 2]  # float32 elements
    entries = items([("allreduce", np.float32, n) for n in sizes])
    plan = plan_buckets(entries, bucket_bytes=120, first_bucket_bytes=40)
    for earlier, later in zip(plan, plan[1:]):
        cap = 40 if earlier.index == 0 else 120
        next_bytes = entries[later.members[0]].num_elements * 4
        assert earlier.payload_bytes >= cap or earlier.payload_bytes + next_bytes > cap
    check_plan(entries, plan, 120, 40)
    # Bucket 0 is the last item alone (8 bytes; with the next one's 120 it would pass 40); a
    # bucket that reaches its cap closes at once (120, 160 bytes).
    assert [b.members for b in plan] == [(10,), (9,), (8, 7, 6), (5, 4, 3), (2,), (1, 0)]
