"""buckets.aligned_empty: the arrays that numpy_function ops hand to TensorFlow, and what
TensorFlow does with them without copying; graph_ops.run_buckets on in-process loopback ranks
(real engines): a group of all-reduce and SFB buckets, eagerly and traced."""

import numpy as np
import pytest
import tensorflow as tf

from tf_poseidon.comm import buckets, codecs, engine as engine_lib, graph_ops
from tf_poseidon.comm.buckets import Item, plan_buckets
from tf_poseidon.comm.protocol import AllReduce
from tf_poseidon.sfb import protocol as sfb_protocol
from tf_poseidon.testing.loopback import LoopbackWorld


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


def test_assign_add_of_an_adopted_output_updates_the_variable_in_place():
    # Why SSP holds no more than two buffers per bucket beyond the variables (algorithms/ssp.py):
    # W += correction, the correction an adopted numpy_function output, writes into the
    # variable's own buffer — also after the step has read the variable for its exchange.
    variable = tf.Variable(tf.ones([512, 256]))
    correction = buckets.aligned_empty(512 * 256, np.float32)
    correction[:] = 2.0

    def address(tensor):
        return tf.numpy_function(lambda a: np.int64(a.ctypes.data), [tensor], tf.int64,
                                 stateful=True)

    @tf.function(autograph=False)
    def step():
        before = address(tf.identity(variable))  # the exchange's read of the updated values
        with tf.control_dependencies([before]):
            piece = tf.numpy_function(lambda: correction, [], tf.float32, stateful=True)
            update = variable.assign_add(tf.reshape(piece, variable.shape))
        with tf.control_dependencies([update]):
            return before, address(variable.read_value())
    before, after = step()
    assert int(before) == int(after)
    np.testing.assert_array_equal(variable.numpy(), 3.0)


# -- run_buckets on loopback ranks -------------------------------------------------------------

SFB_SHAPE = (6, 4)  # the Dense kernel whose factors travel
ROWS = [3, 0, 5]  # each rank's K: rank 1 has no rows (an uneven last batch)


def gradients(rank):
    """Rank ``rank``'s gradients in forward order: a bias, the kernel's factors, a kernel."""
    rng = np.random.default_rng(rank)
    u = rng.normal(size=(ROWS[rank], SFB_SHAPE[0])).astype(np.float32)
    v = rng.normal(size=(ROWS[rank], SFB_SHAPE[1])).astype(np.float32)
    return (rng.normal(size=(5,)).astype(np.float32), u, v,
            rng.normal(size=(3, 2)).astype(np.float64))


def run_mixed_group(comm, traced, calls):
    """Every call of one group of all-reduce and SFB buckets through run_buckets (eagerly or
    in a tf.function), on a real engine; returns each call's sums and reconstructed kernel."""
    engine, sequencer = engine_lib.CommEngine(comm), graph_ops.Sequencer()
    bias, u, v, kernel = gradients(comm.Get_rank())
    items = [Item("bias", (5,), np.dtype(np.float32), 5),
             sfb_protocol.item("sfb_kernel", *SFB_SHAPE, rows_estimate=4),
             Item("kernel", (3, 2), np.dtype(np.float64), 6)]
    plan = plan_buckets(items, bucket_bytes=1, first_bucket_bytes=1)  # a bucket each
    group = engine_lib.CollectiveGroup("gradients", plan, {
        "allreduce": AllReduce(codecs.Exact()), sfb_protocol.KIND:
        sfb_protocol.SfbProtocol(codecs.Exact())})

    def step(bias, u, v, kernel):
        summed_bias, factors, summed_kernel = graph_ops.run_buckets(
            engine, sequencer, group, [[bias], [u, v], [kernel]])
        return summed_bias, sfb_protocol.reconstruct(factors, SFB_SHAPE, tf.float32), \
            summed_kernel

    if traced:
        step = tf.function(step, input_signature=[
            tf.TensorSpec([5]), tf.TensorSpec([None, SFB_SHAPE[0]]),
            tf.TensorSpec([None, SFB_SHAPE[1]]), tf.TensorSpec([3, 2], tf.float64)])
    return [[t.numpy() for t in step(bias * c, u * c, v, kernel * c)] for c in range(1, calls + 1)]


@pytest.mark.parametrize("num_ranks, traced", [(2, False), (3, False), (2, True)])
def test_run_buckets_sums_and_gathers_factors_on_every_rank(monkeypatch, num_ranks, traced):
    # Traced at 2 ranks only: each rank's collect op blocks one of TensorFlow's inter-op
    # threads (as many as cores, 2 on CI) until every rank has handed the bucket over.
    monkeypatch.setenv("TF_POSEIDON_TIMEOUT", "30")
    calls = 2
    results = LoopbackWorld(num_ranks, timeout_s=30).run(
        lambda comm: run_mixed_group(comm, traced, calls))
    ranks = [gradients(rank) for rank in range(num_ranks)]
    for call in range(calls):
        c = call + 1
        expected = [sum(g[0] for g in ranks) * c,
                    sum(g[1].astype(np.float64).T @ g[2] for g in ranks) * c,
                    sum(g[3] for g in ranks) * c]
        for rank_results in results:
            for got, want, dtype in zip(rank_results[call], expected,
                                        [np.float32, np.float32, np.float64]):
                assert got.dtype == dtype
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
