"""Fuzzed checks of the compiled kernels on every device TensorFlow has: sizes 0, 1, odd and not
multiples of the kernels' vector and block widths; NaN of both signs and with payloads, ±Inf,
±0, float32 and bfloat16 denormals, values beyond the float16 range; every dtype pair. Results
are compared with numpy references bit for bit (pack, unpack, sum_chunks) and within float32
rounding of float64 (sfb_reconstruct). On a machine with a GPU (ci/check_gpu.sh) the same tests
run the GPU kernels too and compare them with the CPU kernels: bit for bit for pack/unpack
(NaN payloads included) and sum_chunks (a NaN sum is one canonical NaN), within float32
rounding for reconstruction.

Numbers follow TensorFlow's float32 environment: its CPU kernels run with flush-to-zero and
denormals-are-zero, and the CUDA kernels are compiled with -ftz=true, so float32 (and bfloat16)
denormals read or produced in float32 arithmetic are zeros of the same sign.

``TF_POSEIDON_BIG_TESTS=1`` adds a pack/unpack of more than 2^31 elements (16 GB of memory on
each device; ci/check_gpu.sh sets it)."""

import os

import numpy as np
import pytest
import tensorflow as tf

from test_ops import FLOATS, np_dtype
from tf_poseidon import ops

DEVICES = ["CPU"] + (["GPU"] if tf.config.list_physical_devices("GPU") else [])
# 0, 1, odd, and around the GPU kernel's 4096-element blocks and the CPU kernel's 16384.
SIZES = [0, 1, 2, 7, 31, 33, 1023, 4095, 4097, 16385, 100003]
SHAPES = [(n,) for n in SIZES] + [(), (3, 0, 2), (33, 31)]
SCALES = [1.0, 0.5, 1.0 / 3, 2.0 ** -10]
FLOAT32_TINY = np.float32(2.0 ** -126)
CANONICAL_NAN = np.uint32(0x7FC00000).view(np.float32)

# float32 bit patterns: NaNs (both signs, payloads, signalling), ±Inf, ±0, float32 denormals,
# values around and beyond the float16 range, float16 subnormals, bfloat16 denormals.
SPECIALS = np.array([
    0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFF800001, 0x7F800000, 0xFF800000, 0x00000000,
    0x80000000, 0x00000001, 0x807FFFFF, 0x00400000, 0x477FE000, 0xC77FF000, 0x47800000,
    0x4B000000, 0x7F7FFFFF, 0x33800000, 0xB3000000, 0x387FC000, 0x00010000, 0x80008000,
], np.uint32).view(np.float32)


def fuzz(rng: np.random.Generator, shape, dtype: tf.DType) -> np.ndarray:
    """Random signs and magnitudes 1e-8 .. 3e4; about one element in 7 a special value."""
    size = int(np.prod(shape))
    values = (10.0 ** rng.uniform(-8, 4.5, size)).astype(np.float32)
    values *= rng.choice(np.array([-1, 1], np.float32), size)
    special = rng.random(size) < 1 / 7
    values[special] = rng.choice(SPECIALS, int(special.sum()))
    with np.errstate(all="ignore"):
        return values.reshape(shape).astype(np_dtype(dtype))


def flush(values: np.ndarray) -> np.ndarray:
    """Float32 ``values`` with denormals replaced by zeros of the same sign (FTZ/DAZ)."""
    values = values.copy()
    tiny = (np.abs(values) < FLOAT32_TINY) & (values != 0)
    values[tiny] = np.copysign(np.float32(0), values[tiny])
    return values


def convert_reference(values: np.ndarray, out: tf.DType, scale: float) -> np.ndarray:
    """out(float32(values) * scale) in TensorFlow's float32 environment; a NaN stays itself."""
    x = flush(values.astype(np.float32).ravel())
    with np.errstate(all="ignore"):
        y = flush(x * np.float32(scale))
        nan = np.isnan(x)
        y[nan] = x[nan]
        return y.astype(np_dtype(out))


def assert_same_values(got: np.ndarray, expected: np.ndarray, nan_sign: bool = True) -> None:
    """Equal bits, except that a NaN need only be a NaN (of the same sign, with ``nan_sign``):
    numpy and the kernels keep different NaN payloads when narrowing."""
    got, expected = np.asarray(got).ravel(), np.asarray(expected).ravel()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    bits = np.uint32 if got.dtype.itemsize == 4 else np.uint16
    nan = np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(got.view(bits)[~nan], expected.view(bits)[~nan])
    if nan_sign:
        np.testing.assert_array_equal(np.signbit(got.astype(np.float32)[nan]),
                                      np.signbit(expected.astype(np.float32)[nan]))


def on(device: str, call):
    """``call()`` with its ops placed on ``device``; checks that they ran there."""
    with tf.device(f"/{device}:0"):
        result = call()
    for tensor in result if isinstance(result, list) else [result]:
        assert tensor.device.endswith(f"{device}:0"), tensor.device
    return result


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261130)


@pytest.fixture
def exact_float32():
    """TensorFloat-32 off: a GPU GEMM then rounds like float32 (TF's default rounds inputs to
    10 mantissa bits on Ampere and newer, in tf.matmul and in sfb_reconstruct alike)."""
    enabled = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    yield
    tf.config.experimental.enable_tensor_float_32_execution(enabled)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_pack_fuzz(rng, device, dtype, wire):
    arrays = [fuzz(rng, shape, dtype) for shape in SHAPES]
    for scale in SCALES:
        packed = on(device, lambda: ops.pack(arrays, wire, scale))
        expected = np.concatenate([convert_reference(a, wire, scale) for a in arrays])
        assert_same_values(packed.numpy(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: d.name)
def test_unpack_fuzz(rng, device, wire, out):
    sizes = [int(np.prod(s)) for s in SHAPES]
    buffer = fuzz(rng, (sum(sizes),), wire)
    for unscale in SCALES:
        tensors = on(device, lambda: ops.unpack(buffer, SHAPES, [out] * len(SHAPES), unscale))
        parts = np.split(convert_reference(buffer, out, unscale), np.cumsum(sizes)[:-1])
        for tensor, part, shape in zip(tensors, parts, SHAPES):
            assert tensor.shape == shape
            assert_same_values(tensor.numpy(), part)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: d.name)
def test_sum_chunks_fuzz(rng, device, wire, out):
    for p, n in [(0, 5), (1, 1), (3, 7), (2, 4097), (5, 1023)]:
        chunks = fuzz(rng, (p, n), wire)
        total = on(device, lambda: ops.sum_chunks(chunks, 0.25, out))
        acc = np.zeros(n, np.float32)
        with np.errstate(all="ignore"):
            for chunk in flush(chunks.astype(np.float32)):  # in rank order
                acc = flush(acc + chunk)
            expected = flush(acc * np.float32(0.25))
            expected[np.isnan(expected)] = CANONICAL_NAN
            expected = expected.astype(np_dtype(out))
        assert_same_values(total.numpy(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out", FLOATS, ids=lambda d: d.name)
def test_sum_chunks_nan_is_canonical(device, out):
    """Whatever NaN the additions make (x86 keeps an operand's payload and sign and makes a
    negative NaN of Inf - Inf; a GPU makes 0x7FFFFFFF), a NaN sum is the quiet NaN 0x7FC00000
    rounded to ``out``: the same bits on every device."""
    # Columns: Inf - Inf, 1 + signalling NaN, negative NaN with a payload + 2, NaN + NaN.
    chunks = np.array([[0x7F800000, 0x3F800000, 0xFFC12345, 0xFFC00000],
                       [0xFF800000, 0x7FA00000, 0x40000000, 0x7FC00001]],
                      np.uint32).view(np.float32)
    total = on(device, lambda: ops.sum_chunks(chunks, 0.5, out)).numpy()
    canonical = np.full(4, CANONICAL_NAN, np.float32).astype(np_dtype(out))
    bits = np.uint32 if out == tf.float32 else np.uint16
    np.testing.assert_array_equal(total.view(bits), canonical.view(bits))


SFB_SHAPES = [(0, 4, 5), (1, 1, 1), (3, 0, 2), (7, 33, 65), (64, 129, 33), (130, 7, 300)]


def sfb_bound(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Float32 rounding of a sum of products: 1e-6 times the sum of their magnitudes."""
    u64, v64 = u.astype(np.float64), v.astype(np.float64)
    return 1e-6 * (np.abs(u64).T @ np.abs(v64) + np.finfo(np.float32).tiny)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_sfb_reconstruct_fuzz(rng, exact_float32, device, dtype):
    for r, m, n in SFB_SHAPES:
        u = rng.standard_normal((r, m)).astype(np_dtype(dtype))
        v = (rng.standard_normal((r, n)) * 10.0 ** rng.uniform(-3, 3, (r, 1))).astype(
            np_dtype(dtype))
        grad = on(device, lambda: ops.sfb_reconstruct(u, v, scale=0.5)).numpy()
        expected = 0.5 * u.astype(np.float64).T @ v.astype(np.float64)
        assert grad.dtype == np.float32 and grad.shape == (m, n)
        assert np.all(np.abs(grad - expected) <= 0.5 * sfb_bound(u, v))
    u = np.ones((3, 4), np_dtype(dtype))
    u[1, 2] = np.nan
    grad = on(device, lambda: ops.sfb_reconstruct(u, np.ones((3, 5), np_dtype(dtype)))).numpy()
    assert np.isnan(grad[2]).all() and np.isfinite(grad[[0, 1, 3]]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_nan_keeps_its_sign_and_payload(device):
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7FC12000, 0xFFA00000], np.uint32).view(np.float32)
    packed = on(device, lambda: ops.pack([nans], tf.float32, 0.5)).numpy()
    np.testing.assert_array_equal(packed.view(np.uint32), nans.view(np.uint32) | 0x00400000)
    for wire in (tf.float16, tf.bfloat16):
        narrow = on(device, lambda: ops.pack([nans], wire, 0.5)).numpy()
        np.testing.assert_array_equal(np.signbit(narrow.astype(np.float32)), [0, 1, 0, 1])
        [back] = on(device, lambda: ops.unpack(narrow, [(4,)], [tf.float32], 2.0))
        assert np.isnan(back.numpy()).all()
        np.testing.assert_array_equal(np.signbit(back.numpy()), [0, 1, 0, 1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("u_shape,v_shape", [([2**31, 0], [2**31, 0]), ([0, 2**31], [0, 1]),
                                             ([0, 1], [0, 2**31])])
def test_gemm_dimensions_beyond_int32_are_refused(device, u_shape, v_shape):
    """cuBLAS takes int dimensions; every device refuses R, M or N >= 2^31 with the same error
    (checked here on empty tensors, before any allocation)."""
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"below 2\^31"):
        on(device, lambda: ops.sfb_reconstruct(tf.zeros(u_shape), tf.zeros(v_shape)))


needs_gpu = pytest.mark.skipif("GPU" not in DEVICES, reason="no GPU visible to TensorFlow")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_gpu_pack_unpack_equal_cpu_bit_for_bit(rng, dtype, wire):
    arrays = [fuzz(rng, shape, dtype) for shape in SHAPES]
    for scale in SCALES:
        packed = {d: on(d, lambda: ops.pack(arrays, wire, scale)).numpy() for d in DEVICES}
        bits = np.uint32 if wire == tf.float32 else np.uint16
        np.testing.assert_array_equal(packed["GPU"].view(bits), packed["CPU"].view(bits))
        shapes, dtypes = SHAPES, [dtype] * len(SHAPES)
        back = {d: on(d, lambda: ops.unpack(packed["CPU"], shapes, dtypes, 1 / scale))
                for d in DEVICES}
        for gpu, cpu in zip(back["GPU"], back["CPU"]):
            bits = np.uint32 if dtype == tf.float32 else np.uint16
            np.testing.assert_array_equal(gpu.numpy().view(bits), cpu.numpy().view(bits))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("out", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: d.name)
def test_gpu_sum_chunks_equal_cpu(rng, wire, out):
    chunks = fuzz(rng, (4, 100003), wire)
    gpu, cpu = (on(d, lambda: ops.sum_chunks(chunks, 1 / 3, out)).numpy() for d in DEVICES)
    bits = np.uint32 if out == tf.float32 else np.uint16
    np.testing.assert_array_equal(gpu.view(bits), cpu.view(bits))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_gpu_sfb_reconstruct_within_float32_rounding_of_cpu(rng, exact_float32, dtype):
    u = rng.standard_normal((256, 1000)).astype(np_dtype(dtype))
    v = rng.standard_normal((256, 513)).astype(np_dtype(dtype))
    gpu, cpu = (on(d, lambda: ops.sfb_reconstruct(u, v, 0.25)).numpy() for d in DEVICES)
    assert np.all(np.abs(gpu - cpu) <= 0.5 * sfb_bound(u, v))


@pytest.mark.skipif(os.environ.get("TF_POSEIDON_BIG_TESTS") != "1",
                    reason="set TF_POSEIDON_BIG_TESTS=1 (needs 16 GB per device)")
@pytest.mark.parametrize("device", DEVICES)
def test_pack_unpack_beyond_2_31_elements(rng, device):
    """A float16 tensor of 2^31 + 1000 elements (4 GB; element indices beyond int32, byte offsets
    beyond 2^32) followed by a small one, through pack and unpack."""
    big = 2**31 + 1000
    tail = fuzz(rng, (1000,), tf.float16)
    small = fuzz(rng, (37,), tf.float32)

    def run():
        head = tf.concat([tf.zeros([2**31], tf.float16), tail], 0)
        packed = ops.pack([head, small], tf.float16, 0.5)
        return [packed] + ops.unpack(packed, [(big,), (37,)], [tf.float16, tf.float32], 2.0)

    packed, back_big, back_small = (t.numpy() for t in on(device, run))
    expected = np.concatenate([convert_reference(tail, tf.float16, 0.5),
                               convert_reference(small, tf.float16, 0.5)])
    assert_same_values(packed[big - 1000:], expected)
    assert_same_values(back_big[big - 1000:], convert_reference(expected[:1000], tf.float16, 2.0))
    assert_same_values(back_small, convert_reference(expected[1000:], tf.float32, 2.0))
    assert not packed[:big - 1000].any() and not back_big[:big - 1000].any()
