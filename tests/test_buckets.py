"""Bucket planning: backprop order, caps, one dtype per bucket, every tensor exactly once."""

import numpy as np
import pytest
import tensorflow as tf

from tf_poseidon.comm.buckets import member_slices, plan_buckets


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
