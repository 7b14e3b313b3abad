"""buckets.aligned_empty: the arrays that numpy_function ops hand to TensorFlow, and what
TensorFlow does with them without copying."""

import numpy as np
import pytest
import tensorflow as tf

from tf_poseidon.comm import buckets


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.float16])
@pytest.mark.parametrize("size", [0, 1, 17, 1 << 20])
def test_aligned_empty_starts_on_a_64_byte_boundary(dtype, size):
    array = buckets.aligned_empty(size, dtype)
    assert array.shape == (size,) and array.dtype == dtype
    if size:  # numpy gives an empty view an address of its own; nothing to copy there
        assert array.ctypes.data % buckets.TENSOR_ALIGNMENT == 0
    assert array.flags.c_contiguous and array.flags.writeable


def _address_seen_by_tensorflow(array: np.ndarray) -> int:
    """The address of the tensor a numpy_function op makes of ``array``, as the next op sees it."""
    @tf.function(autograph=False)
    def roundtrip():
        tensor = tf.numpy_function(lambda: array, [], tf.float32, stateful=True)
        return tf.numpy_function(lambda t: np.int64(t.ctypes.data), [tensor], tf.int64,
                                 stateful=True)
    return int(roundtrip())


def test_tensorflow_adopts_an_aligned_output_without_copying_it():
    # Why payloads and results are allocated aligned: an unaligned one is copied (one more
    # pass over every bucket per step). If TensorFlow changes this, the allocation can go.
    aligned = buckets.aligned_empty(1 << 20, np.float32)
    assert _address_seen_by_tensorflow(aligned) == aligned.ctypes.data
    unaligned = buckets.aligned_empty((1 << 20) + 1, np.float32)[1:]
    assert _address_seen_by_tensorflow(unaligned) != unaligned.ctypes.data


def test_a_variable_assigned_an_adopted_output_takes_its_buffer():
    # Why SSP assigns its refreshed values instead of adding the late updates: the assign of a
    # reshaped, adopted numpy_function output makes it the variable's buffer (no pass over it).
    variable = tf.Variable(tf.zeros([512, 256]))
    refreshed = buckets.aligned_empty(512 * 256, np.float32)
    refreshed[:] = 3.0

    @tf.function(autograph=False)
    def assign():
        tensor = tf.numpy_function(lambda: refreshed, [], tf.float32, stateful=True)
        variable.assign(tf.reshape(tensor, variable.shape))
        return tf.numpy_function(lambda v: np.int64(v.ctypes.data), [variable.read_value()],
                                 tf.int64, stateful=True)
    assert int(assign()) == refreshed.ctypes.data
    np.testing.assert_array_equal(variable.numpy(), 3.0)
