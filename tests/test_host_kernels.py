"""tf_poseidon.host_kernels (the kernels' loops on numpy buffers, used by the engine thread)
against numpy references, bit for bit: the compiled C API must be in use (conftest sets
TF_POSEIDON_REQUIRE_OPS=1), and the numpy fallback must meet the same contracts."""

import numpy as np
import pytest
import tensorflow as tf

from test_ops import FLOATS, np_dtype, pack_reference, random_values
from tf_poseidon import host_kernels

SIZES = [0, 1, 7, 1023, 100003]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261129)


@pytest.fixture(params=["compiled", "numpy"])
def kernels(request, monkeypatch):
    """host_kernels with the compiled C API, or with its numpy fallback."""
    if request.param == "compiled":
        assert host_kernels.available()
    else:
        monkeypatch.setattr(host_kernels, "_c_api", lambda: None)
    return host_kernels


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dst", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("src", FLOATS, ids=lambda d: d.name)
def test_convert_matches_numpy(kernels, rng, src, dst, size):
    values = random_values(rng, (size,), src)
    out = np.full(size, 7, np_dtype(dst))
    kernels.convert(values, out, 0.5)
    np.testing.assert_array_equal(out, pack_reference([values], dst, 0.5))


def test_convert_writes_float32_in_place(kernels, rng):
    values = random_values(rng, (1023,), tf.float32)
    expected = values * np.float32(3.0)
    kernels.convert(values, values, 3.0)
    np.testing.assert_array_equal(values, expected)


def test_fp16_scaling_keeps_values_beyond_65504_finite(kernels, rng):
    values = rng.uniform(-1e6, 1e6, size=1023).astype(np.float32)
    values[:2] = [1e6, -1e6]
    wire = np.empty(values.size, np.float16)
    kernels.convert(values, wire, 1.0 / 32)
    assert np.all(np.isfinite(wire))
    back = np.empty_like(values)
    kernels.convert(wire, back, 32.0)
    np.testing.assert_allclose(back, values, rtol=1e-3)


@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: d.name)
def test_nan_and_inf_propagate(kernels, rng, wire):
    values = random_values(rng, (7,), tf.float32)
    values[[1, 3, 5]] = [np.nan, np.inf, -np.inf]
    packed = np.empty(7, np_dtype(wire))
    kernels.convert(values, packed)
    summed = np.empty(7, np.float32)
    kernels.sum_chunks(np.stack([packed, packed]), summed)
    for result in (packed.astype(np.float32), summed):
        assert np.isnan(result[1]) and result[3] == np.inf and result[5] == -np.inf


@pytest.mark.parametrize("out", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("wire", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("p,n", [(0, 5), (1, 1), (3, 100003), (4, 0), (5, 7)])
def test_sum_chunks_matches_numpy(kernels, rng, wire, out, p, n):
    chunks = random_values(rng, (p, n), wire)
    total = np.full(n, 7, np_dtype(out))
    kernels.sum_chunks(chunks, total, 0.25)
    expected = np.zeros(n, np.float32)
    for chunk in chunks:  # in rank order, as the contract says
        expected += chunk.astype(np.float32)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(total, (expected * np.float32(0.25)).astype(np_dtype(out)))


@pytest.mark.parametrize("size", SIZES)
def test_max_abs(kernels, rng, size):
    values = random_values(rng, (size,), tf.float32)
    assert kernels.max_abs(values) == (float(np.abs(values).max()) if size else 0.0)


def test_max_abs_sees_nan_and_inf_anywhere(kernels, rng):
    values = random_values(rng, (100003,), tf.float32)
    values[70001] = -np.inf
    assert kernels.max_abs(values) == np.inf
    values[123] = np.nan
    assert np.isnan(kernels.max_abs(values))


@pytest.mark.parametrize("call, message", [
    (lambda: host_kernels.convert(np.zeros(3, np.float32), np.zeros(4, np.float16)),
     "src has 3 elements but dst has 4"),
    (lambda: host_kernels.convert(np.zeros(3, np.float64), np.zeros(3, np.float16)),
     "src must be a numpy array of float32, float16 or bfloat16, got float64"),
    (lambda: host_kernels.convert(np.zeros((4, 4), np.float32)[:, 1], np.zeros(4, np.float16)),
     "src must be C-contiguous"),
    (lambda: host_kernels.convert([1.0], np.zeros(1, np.float16)),
     "src must be a numpy array"),
    (lambda: host_kernels.sum_chunks(np.zeros(6, np.float16), np.zeros(6, np.float32)),
     "chunks must be [P, n]"),
    (lambda: host_kernels.sum_chunks(np.zeros((2, 6), np.float16), np.zeros(5, np.float32)),
     "out have n elements"),
    (lambda: host_kernels.max_abs(np.zeros(3, np.float16)), "x must be float32"),
])
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises(ValueError) as error:
        call()
    assert message in str(error.value)
