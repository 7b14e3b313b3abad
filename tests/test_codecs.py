"""Codecs in this process: each block's encode/decode round trip, and the sum over P = 1..4 ranks
of the in-process loopback communicator (identical on every rank, within the codec's rounding
of the exact sum), for the built-in codecs and one defined here, outside the package.

Bounds, for values of largest magnitude A over P ranks: fp16 rounds each scaled value and each
scaled sum to 11 significant bits (half an ulp: 2^-11 relative), so a sum is off by at most
2^-11·(P·A + P·A); bf16 likewise with 8 bits; the 8-bit min/max codec by half a step (its
block's range / 255 / 2) per value and per sum.
"""

import copy

import numpy as np
import pytest

from tf_poseidon.comm import codecs
from tf_poseidon.testing.loopback import LoopbackWorld


class MinMaxUInt8(codecs.Codec):
    """8 bits per value: each block as its minimum and maximum and 255 steps between."""

    name, wire_dtype, meta_size = "test-minmax8", np.dtype(np.uint8), 2

    def encode(self, block, out):
        lo, hi = (float(block.min()), float(block.max())) if block.size else (0.0, 0.0)
        out[...] = np.rint((block - lo) / self._step(lo, hi))
        return np.array([lo, hi])

    def decode(self, wire, meta, out):
        lo, hi = meta
        out[...] = lo + wire.astype(np.float64) * self._step(lo, hi)

    @staticmethod
    def _step(lo, hi):
        return (hi - lo) / 255 or 1.0


CODECS = ["none", "fp16", "bf16", "test-minmax8"]
SIZES = [0, 1, 2, 7, 1001]


def codec_named(name):
    """A codec of its own for each rank: in one process, ranks must not share the 16-bit
    codecs' wire buffers (separate processes never do)."""
    return MinMaxUInt8() if name == "test-minmax8" else copy.deepcopy(codecs.get(name))


def round_trip_bound(name, block):
    amax = float(np.max(np.abs(block), initial=0.0))
    if name == "test-minmax8":
        return (float(block.max()) - float(block.min())) / 510 * 1.001 if block.size else 0.0
    return {"none": 0.0, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}[name] * amax * 1.001


def sum_bound(name, num_ranks, amax):
    per_value = {"none": 2.0 ** -23, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8,
                 "test-minmax8": 1 / 255}[name]
    return per_value * 2 * num_ranks * amax * 1.001


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", CODECS)
def test_encode_decode_round_trip(name, size):
    codec = codec_named(name)
    block = (np.random.default_rng(size).normal(size=size) * 3.0).astype(np.float32)
    wire = np.empty(size, codec.wire_dtype)
    meta = np.asarray(codec.encode(block, wire), np.float64)
    assert meta.shape == (codec.meta_size,)
    decoded = np.empty(size, np.float32)
    codec.decode(wire, meta, decoded)
    np.testing.assert_allclose(decoded, block, rtol=0, atol=round_trip_bound(name, block))


def summed_on_every_rank(name, payloads, in_place=False):
    """Each rank's ``sum_into`` of its payload (its own codec); checks the payload is left
    alone unless summed in place."""
    def rank_main(comm):
        codec, payload = codec_named(name), payloads[comm.rank].copy()
        unwritten = np.nan if payload.dtype.kind == "f" else -1
        out = payload if in_place else np.full_like(payload, unwritten)
        assert codec.sum_into(comm, payload, out) is out
        if not in_place:
            np.testing.assert_array_equal(payload, payloads[comm.rank])
        return out
    return LoopbackWorld(len(payloads)).run(rank_main)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("name", CODECS)
def test_sum_over_ranks_is_identical_everywhere_and_within_the_codecs_rounding(name, num_ranks,
                                                                              size):
    rng = np.random.default_rng(100 * num_ranks + size)
    payloads = [(rng.normal(size=size) * (rank + 1)).astype(np.float32)
                for rank in range(num_ranks)]
    results = summed_on_every_rank(name, payloads)
    for result in results:
        np.testing.assert_array_equal(result, results[0])
    exact = np.sum(payloads, axis=0, dtype=np.float64)
    amax = max((float(np.max(np.abs(p), initial=0.0)) for p in payloads), default=0.0)
    np.testing.assert_allclose(results[0], exact, rtol=0, atol=sum_bound(name, num_ranks, amax))
    for result in summed_on_every_rank(name, payloads, in_place=True):
        np.testing.assert_array_equal(result, results[0])


@pytest.mark.parametrize("name", CODECS)
def test_float64_buckets_are_summed_and_integer_buckets_exactly_or_refused(name):
    payloads = [np.array([0.5, -1.25, 3.0]) * (rank + 1) for rank in range(3)]
    [summed, *_] = summed_on_every_rank(name, payloads)
    assert summed.dtype == np.float64
    np.testing.assert_allclose(summed, [3.0, -7.5, 18.0], rtol=0, atol=sum_bound(name, 3, 9.0))
    integers = [np.array([2 ** 40 + rank, -rank], np.int64) for rank in range(3)]
    if name == "none":
        [summed, *_] = summed_on_every_rank(name, integers)
        assert summed.tolist() == [3 * 2 ** 40 + 3, -3]
    else:
        with pytest.raises(TypeError, match="sums floating values only, got a int64 bucket"):
            summed_on_every_rank(name, integers)


@pytest.mark.parametrize("magnitude", [1e6, 1e-35, 1e-40])
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_fp16_keeps_values_beyond_its_range_and_tiny_ones(magnitude, num_ranks):
    # Beyond 65504 the scale is below 1; for tiny values it is capped at MAX_SCALE (2^126), or
    # it would overflow float32 (16376 / (P·1e-35) > 3.4e38) and every sum would be inf.
    rng = np.random.default_rng(7)
    payloads = [(rng.uniform(-1, 1, 257) * magnitude).astype(np.float32)
                for _ in range(num_ranks)]
    results = summed_on_every_rank("fp16", payloads)
    exact = np.sum(payloads, axis=0, dtype=np.float64)
    amax = max(float(np.max(np.abs(p))) for p in payloads)
    assert np.all(np.isfinite(results[0]))
    np.testing.assert_allclose(results[0], exact, rtol=0,
                               atol=sum_bound("fp16", num_ranks, amax))
    block = payloads[0]
    wire = np.empty(block.size, np.float16)
    [scale] = codecs.get("fp16").encode(block, wire)
    assert scale == (codecs.MAX_SCALE if magnitude < 1e-30 else 2.0 ** np.floor(
        np.log2(codecs.FP16_MAX / 2 / np.max(np.abs(block)))))
    decoded = np.empty_like(block)
    codecs.get("fp16").decode(wire, np.array([scale]), decoded)
    np.testing.assert_allclose(decoded, block, rtol=0, atol=round_trip_bound("fp16", block))
