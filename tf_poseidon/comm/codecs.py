"""Codecs: how float values travel on the wire, and how a bucket of them is summed over ranks.

A :class:`Codec` is a small object with a stated contract (Horovod's ``Compressor``, plus the
sum it implies). It declares

* ``wire_dtype``: the numpy dtype of the elements it sends, and so its ``bytes_per_element``;
* ``meta_size``: how many float64 numbers of metadata each encoded block carries (its *scale
  policy*: none, one scale, a minimum and a maximum, ...);
* ``encode(block, out) -> meta`` and ``decode(wire, meta, out)``: one block of float32 values
  to wire elements and back (SFB's factors, sparse rows and any generic sum use these);
* ``sum_into(comm, payload, out)``: a bucket's sum over ranks. The base class implements it from
  ``encode``/``decode`` (all-to-all of encoded segments, float32 sums, all-gather of the encoded
  sums: every rank decodes the same bytes, so every rank gets the same result); a codec may
  override it with something faster;
* ``pack_dtype``: the dtype in which a float32 bucket packed on its device (comm/datapath.py)
  reaches ``sum_into``: float32, or the wire dtype where converting to it needs nothing from
  the other ranks (bf16), so that the conversion runs on the device, fused into the pack;
* ``tunable``: whether ``PoseidonStrategy(autotune=True)`` may send a bucket exactly instead
  where that is faster (the built-in 16-bit codecs; a codec of your own is kept unless it says
  so).

``PoseidonStrategy(compression=...)`` takes a registered name (``"none"``, ``"fp16"``,
``"bf16"``) or a Codec instance; :func:`register` adds a name. A codec outside the package is a
subclass with ``name``, ``wire_dtype``, ``meta_size``, ``encode`` and ``decode``::

    class MinMaxUInt8(tp.codecs.Codec):
        name, wire_dtype, meta_size = "minmax8", np.dtype(np.uint8), 2
        def encode(self, block, out): ...   # returns np.array([lo, hi])
        def decode(self, wire, meta, out): ...

The built-in 16-bit codecs are Theano-MPI's "asa16" exchanger with two changes, explained in
docs/compression.md ("16-bit wire formats"): sums accumulated in float32, and for fp16 a
per-bucket scale that keeps every value, and every sum of P of them, inside fp16's range. Open MPI's own float16 reduction
is not used: it is slow and accumulates in float16.

All methods run on the engine thread (comm/engine.py) on numpy buffers; ``sum_into`` is a
collective (every rank calls it for the same bucket in the same order) and blocks until done.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from tf_poseidon import host_kernels
from tf_poseidon.comm import collectives
from tf_poseidon.registry import Registry

FP16_MAX = 65504.0
FP16_LIMIT = FP16_MAX / 4  # headroom below fp16's largest value for the rounding of the sums
MAX_SCALE = 2.0 ** 126
"""The largest scale a 16-bit codec applies: beyond it float32 overflows (a bucket whose largest
magnitude is below ~1e-34 would get an infinite scale), and 1/MAX_SCALE is still a normal
float32, so unscaling is exact."""


class Codec:
    """The contract of a wire format (see the module docstring). Subclass and set the class
    attributes; instances must be usable from the engine thread (no TensorFlow calls)."""

    name: str = ""
    wire_dtype: np.dtype = np.dtype(np.float32)
    meta_size: int = 0
    pack_dtype: np.dtype = np.dtype(np.float32)
    tunable: bool = False
    """Whether the autotuner (comm/autotune.py) may sum a bucket exactly instead, where that is
    faster: a codec whose only purpose is fewer bytes (the built-in 16-bit ones). False keeps
    the codec on every bucket, whatever it costs."""

    @property
    def bytes_per_element(self) -> float:
        """Bytes one float32 value takes on the wire (the cost model's b)."""
        return float(np.dtype(self.wire_dtype).itemsize)

    def encode(self, block: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Writes ``block`` (1-D float32) into ``out`` (1-D ``wire_dtype``, same size) and
        returns its metadata, a float64 array of ``meta_size`` numbers."""
        raise NotImplementedError

    def decode(self, wire: np.ndarray, meta: np.ndarray, out: np.ndarray) -> None:
        """Writes the float32 values of ``wire`` (encoded with ``meta``) into ``out`` (1-D
        float32, same size)."""
        raise NotImplementedError

    def sum_into(self, comm, payload: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Collective: the sum over ranks of the 1-D float ``payload`` into ``out`` (same size
        and dtype; may be ``payload`` itself), identical on every rank; returns ``out``.
        ``payload`` is float32, float64 or ``pack_dtype``, and is left as it is unless it is
        ``out``. Raises TypeError for a non-float payload."""
        if payload.dtype != np.float32:
            return _through_float32(self, comm, payload, out)
        size, n = comm.Get_size(), payload.size
        segment = -(-n // size)
        valid = [max(0, min(segment, n - p * segment)) for p in range(size)]
        wire = np.dtype(self.wire_dtype)
        sent = np.zeros(size * segment, wire)
        metas = np.zeros((size, self.meta_size), np.float64)
        for p in range(size):
            start = p * segment
            metas[p] = self.encode(payload[start:start + valid[p]],
                                   sent[start:start + valid[p]])
        received = np.empty_like(sent)
        comm.Alltoall(_bytes(sent), _bytes(received))
        received_metas = np.empty_like(metas)
        if self.meta_size:
            comm.Alltoall(metas, received_metas)
        rank = comm.Get_rank()
        mine = valid[rank]
        total = np.zeros(mine, np.float32)
        decoded = np.empty(mine, np.float32)
        for q in range(size):
            self.decode(received[q * segment:q * segment + mine], received_metas[q], decoded)
            total += decoded
        summed = np.zeros(segment, wire)
        meta = np.asarray(self.encode(total, summed[:mine]), np.float64).reshape(self.meta_size)
        gathered = np.empty(size * segment, wire)
        comm.Allgather(_bytes(summed), _bytes(gathered))
        gathered_metas = np.empty((size, self.meta_size), np.float64)
        if self.meta_size:
            comm.Allgather(meta, gathered_metas)
        for p in range(size):
            start = p * segment
            self.decode(gathered[start:start + valid[p]], gathered_metas[p],
                        out[start:start + valid[p]])
        return out

    def wire_bytes(self, num_elements: int, size: int,
                   payload_dtype: np.dtype = np.dtype(np.float32)) -> tuple[float, float]:
        """(sent, received) bytes per rank of ``sum_into`` on a bucket of ``num_elements``
        values of ``payload_dtype`` over ``size`` ranks, by the algorithm's formula (MPI may
        pick another algorithm; the formula is what the statistics report)."""
        moved = 2 * (size - 1) / size * num_elements * self.bytes_per_element
        moved += 2 * (size - 1) * self.meta_size * 8
        return moved, moved

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Exact(Codec):
    """``"none"``: values travel as they are; sums are MPI's all-reduce in the payload's own
    dtype (float32, float64 or int64), so P ranks give one process's sums up to summation
    order."""

    name = "none"
    wire_dtype = np.dtype(np.float32)

    def encode(self, block: np.ndarray, out: np.ndarray) -> np.ndarray:
        out[...] = block
        return np.empty(0)

    def decode(self, wire: np.ndarray, meta: np.ndarray, out: np.ndarray) -> None:
        out[...] = wire

    def sum_into(self, comm, payload: np.ndarray, out: np.ndarray) -> np.ndarray:
        return collectives.allreduce_sum_into(comm, payload, out)

    def wire_bytes(self, num_elements: int, size: int,
                   payload_dtype: np.dtype = np.dtype(np.float32)) -> tuple[float, float]:
        moved = 2 * (size - 1) / size * num_elements * np.dtype(payload_dtype).itemsize
        return moved, moved


class HalfPrecision(Codec):
    """``"fp16"`` and ``"bf16"``: 16 bits on the wire, sums in float32.

    ``sum_into`` of a float32 payload:

    1. scale (fp16 only): every rank takes the same per-bucket scale ``s = LIMIT / (P·amax)``,
       with ``amax`` the largest magnitude of the bucket over all ranks (one 8-byte
       all-reduce), capped at :data:`MAX_SCALE`, so no scaled value — nor a sum of P of them —
       exceeds fp16's range, and small gradients keep their precision. (An Inf anywhere makes
       ``amax`` infinite and ``s = 1``; MPI's MAX may drop a NaN, which the sum propagates.)
       bf16 has float32's range and skips this round (s = 1);
    2. reduce-scatter: the scaled payload is converted to the wire dtype in one pass and cut
       into P equal segments (the last one padded); an all-to-all gives each rank every rank's
       copy of its own segment, which it sums in float32 (``sum_chunks``) and rounds back;
    3. all-gather of the summed segments, then one pass back to float32 times ``1/s``.

    Bytes per rank: (P-1)/P·n·2 in each of steps 2 and 3, half of the float32 ring's. The passes
    are the kernels' loops (tf_poseidon/host_kernels.py) into wire buffers kept between calls.

    bf16's ``pack_dtype`` is bfloat16: a bucket packed on its device arrives already converted
    (``ops.pack`` rounds float32 to nearest even, as the host conversion of step 2 does, so
    these are the same bits), is copied into the wire buffer as it is, and its sum is returned
    in bfloat16 too (step 3 without the pass back to float32; the device unpacks it). fp16's
    ``pack_dtype`` stays float32: its scale (step 1) needs every rank's largest magnitude
    before the conversion (docs/kernels.md).

    ``encode`` of a single block (SFB's factors) scales fp16 by a power of two (exact to undo)
    that brings its largest magnitude to at most FP16_MAX / 2.
    """

    meta_size = 1
    tunable = True

    def __init__(self, name: str, wire_dtype: np.dtype, scaled: bool):
        self.name = name
        self.wire_dtype = np.dtype(wire_dtype)
        self.scaled = scaled
        self.pack_dtype = np.dtype(np.float32) if scaled else self.wire_dtype
        self._buffers: dict[str, np.ndarray] = {}

    def _scratch(self, name: str, size: int) -> np.ndarray:
        """A wire buffer kept between calls and grown to the largest bucket seen (fresh large
        arrays would page-fault through every call). Engine thread only."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.size < size:
            buffer = self._buffers[name] = np.empty(size, self.wire_dtype)
        return buffer[:size]

    def _global_scale(self, comm, payload: np.ndarray) -> float:
        if not self.scaled or payload.size == 0:
            return 1.0
        local = np.array([host_kernels.max_abs(payload)])
        comm.Allreduce(collectives.mpi().IN_PLACE, local, op=collectives.mpi().MAX)
        amax = float(local[0])
        if not np.isfinite(amax) or amax == 0.0:
            return 1.0
        return min(FP16_LIMIT / (comm.Get_size() * amax), MAX_SCALE)

    def sum_into(self, comm, payload: np.ndarray, out: np.ndarray) -> np.ndarray:
        if payload.dtype not in (np.float32, self.pack_dtype):
            return _through_float32(self, comm, payload, out)
        size, n = comm.Get_size(), payload.size
        segment = -(-n // size)
        scale = self._global_scale(comm, payload)
        packed = self._scratch("packed", segment * size)
        if payload.dtype == self.wire_dtype:  # converted on the device (unscaled: bf16)
            packed[:n] = payload
        else:
            host_kernels.convert(payload, packed[:n], scale)
        packed[n:] = 0
        mine = self._scratch("mine", segment * size)
        comm.Alltoall(_bytes(packed), _bytes(mine))
        summed = self._scratch("summed", segment)
        host_kernels.sum_chunks(mine.reshape(size, segment), summed)
        gathered = self._scratch("gathered", segment * size)
        comm.Allgather(_bytes(summed), _bytes(gathered))
        if out.dtype == self.wire_dtype:
            out[...] = gathered[:n]
        else:
            host_kernels.convert(gathered[:n], out, 1.0 / scale)
        return out

    def wire_bytes(self, num_elements: int, size: int,
                   payload_dtype: np.dtype = np.dtype(np.float32)) -> tuple[float, float]:
        moved = 2 * (size - 1) / size * num_elements * self.bytes_per_element
        return moved, moved

    def encode(self, block: np.ndarray, out: np.ndarray) -> np.ndarray:
        scale = self._block_scale(block)
        host_kernels.convert(block, out, scale)
        return np.array([scale])

    def decode(self, wire: np.ndarray, meta: np.ndarray, out: np.ndarray) -> None:
        host_kernels.convert(wire, out, 1.0 / float(meta[0]))

    def _block_scale(self, block: np.ndarray) -> float:
        if not self.scaled or block.size == 0:
            return 1.0
        amax = host_kernels.max_abs(np.ascontiguousarray(block, np.float32))
        if not np.isfinite(amax) or amax == 0.0:
            return 1.0
        return float(min(2.0 ** np.floor(np.log2(FP16_MAX / 2 / amax)), MAX_SCALE))


def _through_float32(codec: Codec, comm, payload: np.ndarray, out: np.ndarray) -> np.ndarray:
    """A float64 bucket summed by a codec made for float32 (it travels as float32)."""
    if payload.dtype.kind != "f":
        raise TypeError(f"compression={codec.name!r} sums floating values only, got a "
                        f"{payload.dtype} bucket")
    summed = payload.astype(np.float32)
    out[...] = codec.sum_into(comm, summed, summed)
    return out


def _bytes(array: np.ndarray) -> np.ndarray:
    """``array``'s memory as bytes: MPI moves it without arithmetic (and without knowing
    bfloat16, which mpi4py cannot buffer)."""
    return array.view(np.uint8)


_REGISTRY: Registry[Codec] = Registry("codec", lambda c: isinstance(c, Codec),
                                      "a Codec instance")


def register(codec: Codec) -> Codec:
    """Makes ``codec`` available by its name (``PoseidonStrategy(compression=codec.name)``);
    returns it. Raises ValueError if the name is empty or taken by another codec."""
    return _REGISTRY.register(codec)


def names() -> tuple[str, ...]:
    """The registered codec names, built-in ones first."""
    return _REGISTRY.names()


def get(codec: "str | Codec") -> Codec:
    """The codec for ``compression=codec``: a Codec instance as it is, or a registered name.

    Raises ValueError naming the allowed names for an unknown one.
    """
    if isinstance(codec, Codec):
        return codec
    registered = _REGISTRY.get(codec)
    if registered is not None:
        return registered
    raise ValueError(f"PoseidonStrategy: compression={codec!r} is not valid; allowed values "
                     "are " + ", ".join(repr(n) for n in names()) + " or a "
                     "tf_poseidon.codecs.Codec instance.")


register(Exact())
register(HalfPrecision("fp16", np.dtype(np.float16), scaled=True))
register(HalfPrecision("bf16", np.dtype(ml_dtypes.bfloat16), scaled=False))
