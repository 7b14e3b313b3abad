"""tf_poseidon.ops against numpy references: the compiled kernels must be in use (conftest sets
TF_POSEIDON_REQUIRE_OPS=1) and agree bit for bit where the contract fixes every rounding."""

import threading

import numpy as np
import pytest
import tensorflow as tf

from tf_poseidon import ops

# On a GPU these tests run there (TensorFlow places the ops on it); its float32 GEMMs round to
# TensorFloat-32 by default, and the tests check float32 rounding.
tf.config.experimental.enable_tensor_float_32_execution(False)

FLOATS = [tf.float32, tf.float16, tf.bfloat16]
# Shapes with odd sizes: scalar, 1, 7, 1023, 100003, and empty ones.
SHAPES = [(), (1,), (7,), (0,), (33, 31), (100003,), (3, 0, 2)]


def np_dtype(dtype: tf.DType) -> np.dtype:
    return np.dtype(dtype.as_numpy_dtype)


def random_values(rng: np.random.Generator, shape, dtype: tf.DType) -> np.ndarray:
    """Random signs and magnitudes from 1e-8 to 3e4 (fp16 subnormals included), never all zero."""
    magnitude = 10.0 ** rng.uniform(-8, 4.5, size=shape)
    values = np.where(rng.random(shape) < 0.5, -magnitude, magnitude)
    return values.astype(np.float32).astype(np_dtype(dtype))


def pack_reference(arrays, wire: tf.DType, scale: float) -> np.ndarray:
    """Values beyond the wire's range become inf, as the contract says."""
    flat = [a.astype(np.float32).ravel() * np.float32(scale) for a in arrays]
    with np.errstate(over="ignore"):
        return np.concatenate(flat or [np.zeros(0, np.float32)]).astype(np_dtype(wire))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240531)


def test_compiled_ops_are_in_use():
    assert ops.available()


@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_pack_matches_numpy(rng, dtype, wire):
    arrays = [random_values(rng, shape, dtype) for shape in SHAPES]
    packed = ops.pack(arrays, wire, scale=0.5)
    assert packed.dtype == wire
    np.testing.assert_array_equal(packed.numpy(), pack_reference(arrays, wire, 0.5))


@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: d.name)
def test_pack_mixes_input_dtypes(rng, wire):
    arrays = [random_values(rng, (1023,), d) for d in FLOATS + FLOATS[::-1]]
    packed = ops.pack(arrays, wire, scale=tf.constant(3.0))
    np.testing.assert_array_equal(packed.numpy(), pack_reference(arrays, wire, 3.0))


@pytest.mark.parametrize("out", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: d.name)
def test_unpack_matches_numpy(rng, wire, out):
    sizes = [int(np.prod(s)) for s in SHAPES]
    buffer = random_values(rng, (sum(sizes),), wire)
    dtypes = [out, tf.float32] * 4
    tensors = ops.unpack(buffer, SHAPES, dtypes[: len(SHAPES)], unscale=2.0)
    parts = np.split(buffer.astype(np.float32) * np.float32(2.0), np.cumsum(sizes)[:-1])
    for tensor, part, shape, dtype in zip(tensors, parts, SHAPES, dtypes):
        assert tensor.dtype == dtype and tensor.shape == shape
        np.testing.assert_array_equal(tensor.numpy(), part.reshape(shape).astype(np_dtype(dtype)))


def test_pack_unpack_of_nothing():
    assert ops.pack([], tf.float16).shape == (0,)
    assert ops.unpack(np.zeros(0, np.float16), [], []) == []


def test_fp16_scaling_keeps_values_beyond_65504_finite(rng):
    values = (rng.uniform(-1e6, 1e6, size=1023)).astype(np.float32)
    values[:2] = [1e6, -1e6]
    packed = ops.pack([values], tf.float16, scale=1.0 / 32)
    assert np.all(np.isfinite(packed.numpy()))
    (restored,) = ops.unpack(packed, [values.shape], [tf.float32], unscale=32.0)
    np.testing.assert_allclose(restored.numpy(), values, rtol=1e-3)
    summed = ops.sum_chunks(tf.stack([packed, packed, packed]), scale=32.0 / 3)
    np.testing.assert_allclose(summed.numpy(), values, rtol=1e-3)


@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: d.name)
def test_nan_and_inf_propagate(rng, wire):
    values = random_values(rng, (7,), tf.float32)
    values[[1, 3, 5]] = [np.nan, np.inf, -np.inf]
    packed = ops.pack([values], wire).numpy().astype(np.float32)
    (restored,) = ops.unpack(packed.astype(np_dtype(wire)), [(7,)], [tf.float32])
    summed = ops.sum_chunks(np.stack([packed, packed]).astype(np_dtype(wire)))
    for result in (packed, restored.numpy(), summed.numpy()):
        assert np.isnan(result[1]) and result[3] == np.inf and result[5] == -np.inf
    u = random_values(rng, (2, 3), tf.float32)
    u[0, 1] = np.nan
    grad = ops.sfb_reconstruct(u.astype(np_dtype(wire)), np.ones((2, 4), np_dtype(wire))).numpy()
    assert np.isnan(grad[1]).all() and np.isfinite(grad[[0, 2]]).all()


@pytest.mark.parametrize("out", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: d.name)
def test_sum_chunks_matches_numpy(rng, wire, out):
    chunks = random_values(rng, (3, 100003), wire)
    total = ops.sum_chunks(chunks, scale=0.25, out_dtype=out)
    expected = (chunks.astype(np.float32).sum(axis=0) * np.float32(0.25)).astype(np_dtype(out))
    assert total.dtype == out
    np.testing.assert_array_equal(total.numpy(), expected)


@pytest.mark.parametrize("p,n", [(0, 5), (1, 1), (4, 0), (5, 7), (2, 1023)])
def test_sum_chunks_sizes(rng, p, n):
    chunks = random_values(rng, (p, n), tf.float16)
    expected = chunks.astype(np.float32).sum(axis=0, dtype=np.float32)
    np.testing.assert_array_equal(ops.sum_chunks(chunks).numpy(), expected)


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("r,m,n", [(5, 7, 3), (64, 129, 33), (1, 1, 1), (0, 4, 5), (3, 0, 2)])
def test_sfb_reconstruct_matches_numpy(rng, dtype, r, m, n):
    u = rng.standard_normal((r, m)).astype(np_dtype(dtype))
    v = rng.standard_normal((r, n)).astype(np_dtype(dtype))
    grad = ops.sfb_reconstruct(u, v, scale=0.5)
    u64, v64 = u.astype(np.float64), v.astype(np.float64)
    expected = 0.5 * u64.T @ v64
    assert grad.dtype == tf.float32 and grad.shape == (m, n)
    bound = 1e-6 * (np.abs(u64).T @ np.abs(v64)).max(initial=1.0)
    np.testing.assert_allclose(grad.numpy(), expected, rtol=0, atol=bound)


F16_9 = np.ones(9, np.float16)
F32_2x5 = np.ones((2, 5), np.float32)
F32_1x2x3 = np.ones((1, 2, 3), np.float32)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: ops.unpack(F16_9, [(2, 5)], [tf.float32]), r"packed must have shape \[10\]"),
        (lambda: ops.unpack(F32_2x5, [(2, 5)], [tf.float32]), r"packed must have shape \[10\]"),
        (lambda: ops.sum_chunks(F16_9), r"chunks must have shape \[P, n\]"),
        (lambda: ops.sum_chunks(F32_1x2x3), r"chunks must have shape \[P, n\]"),
        (lambda: ops.sfb_reconstruct(np.ones((3, 4), np.float32), F32_2x5), r"same R"),
        (lambda: ops.sfb_reconstruct(F32_2x5[0], F32_2x5), r"u must have shape \[R, M\]"),
        (lambda: ops.pack([F32_2x5], tf.float16, [1.0, 2.0]), r"scale must be a float32 scalar"),
    ],
)
def test_bad_shapes_raise_clear_errors(call, message):
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        call()


def test_bad_shapes_are_caught_when_tracing():
    with pytest.raises(ValueError, match=r"chunks must have shape \[P, n\]"):
        tf.function(lambda: ops.sum_chunks(tf.ones([6]))).get_concrete_function()
    with pytest.raises(ValueError, match=r"packed must have shape \[10\]"):
        unpack = tf.function(lambda: ops.unpack(tf.ones([9]), [(2, 5)], [tf.float32]))
        unpack.get_concrete_function()


@pytest.mark.parametrize(
    "call",
    [
        lambda: ops.pack([np.ones(3, np.int32)], tf.float16),
        lambda: ops.pack([np.ones(3, np.float64)], tf.float16),
        lambda: ops.pack([np.ones(3, np.float32)], tf.int8),
        lambda: ops.sum_chunks(np.ones((2, 3), np.float32), out_dtype=tf.float64),
        lambda: ops.sfb_reconstruct(np.ones((2, 3), np.float32), np.ones((2, 3), np.float16)),
    ],
)
def test_bad_dtypes_raise(call):
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError)):
        call()


def test_unpack_rejects_partial_shapes():
    with pytest.raises(ValueError, match="fully defined"):
        ops.unpack(np.ones(4, np.float32), [(None, 2)], [tf.float32])


def test_graph_mode_static_shapes_and_no_gradient(rng):
    a = random_values(rng, (4, 5), tf.float32)
    b = random_values(rng, (3,), tf.bfloat16)

    @tf.function
    def roundtrip(a, b, scale):
        with tf.GradientTape() as tape:
            tape.watch(a)
            packed = ops.pack([a, b], tf.float16, scale)
            loss = tf.reduce_sum(tf.cast(packed, tf.float32))
        assert packed.shape == (23,)
        x, y = ops.unpack(packed, [(4, 5), (3,)], [tf.float32, tf.bfloat16], 1.0 / scale)
        assert x.shape == (4, 5) and y.shape == (3,)
        total = ops.sum_chunks(tf.reshape(packed, [1, 23]), out_dtype=tf.float16)
        grad = ops.sfb_reconstruct(tf.reshape(a, [5, 4]), tf.reshape(a, [5, 4]))
        assert total.shape == (23,) and grad.shape == (4, 4)
        assert tape.gradient(loss, a) is None
        return packed, x, y

    packed, x, y = roundtrip(a, b, tf.constant(0.5))
    np.testing.assert_array_equal(packed.numpy(), ops.pack([a, b], tf.float16, 0.5).numpy())
    wire_a = pack_reference([a], tf.float16, 0.5).astype(np.float32)
    np.testing.assert_array_equal(x.numpy(), (wire_a * 2).reshape(4, 5))
    np.testing.assert_array_equal(y.numpy(), b)


def test_unknown_static_shape_gives_unknown_packed_length():
    fn = tf.function(lambda t: ops.pack([t], tf.float16), input_signature=[tf.TensorSpec([None])])
    assert fn.get_concrete_function().structured_outputs.shape.as_list() == [None]


def test_eager_from_background_thread_on_numpy(rng):
    arrays = [random_values(rng, (100003,), tf.float32), random_values(rng, (7, 3), tf.float16)]
    results = {}

    def work():
        packed = ops.pack(arrays, tf.bfloat16)
        results["out"] = ops.unpack(packed, [a.shape for a in arrays], [tf.float32, tf.float16])

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    wire = pack_reference(arrays, tf.bfloat16, 1.0).astype(np.float32)
    first, second = results["out"]
    np.testing.assert_array_equal(first.numpy(), wire[:100003])
    np.testing.assert_array_equal(second.numpy().ravel(), wire[100003:].astype(np.float16))


@pytest.mark.parametrize("wire", [tf.float16, tf.bfloat16], ids=lambda d: d.name)
def test_composite_fallback_meets_the_same_contracts(rng, wire):
    composite = ops.CompositeOps
    arrays = [random_values(rng, shape, tf.float32) for shape in SHAPES]
    scale = tf.constant(0.5)
    packed = composite.pack([tf.constant(a) for a in arrays], wire, scale)
    np.testing.assert_array_equal(packed.numpy(), pack_reference(arrays, wire, 0.5))
    shapes, dtypes = [tf.TensorShape(s) for s in SHAPES], [tf.float32] * len(SHAPES)
    restored = composite.unpack(packed, shapes, dtypes, 1 / scale)
    for tensor, expected in zip(restored, ops.unpack(packed, SHAPES, dtypes, 2.0)):
        np.testing.assert_array_equal(tensor.numpy(), expected.numpy())
    chunks = tf.constant(random_values(rng, (3, 1023), wire))
    summed = composite.sum_chunks(chunks, scale, tf.float32)
    np.testing.assert_allclose(summed.numpy(), ops.sum_chunks(chunks, 0.5).numpy(), rtol=1e-6)
    u, v = (tf.constant(rng.standard_normal(s).astype(np_dtype(wire))) for s in [(8, 5), (8, 3)])
    grad = composite.sfb_reconstruct(u, v, scale)
    np.testing.assert_allclose(grad.numpy(), ops.sfb_reconstruct(u, v, 0.5).numpy(), rtol=1e-5)
