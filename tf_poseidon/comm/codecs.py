"""Compressed all-reduce: 16-bit floats on the wire, sums accumulated in float32.

``compressed_allreduce("fp16" | "bf16")`` is a :class:`~tf_poseidon.comm.collectives.Collective`
that takes a float32 payload and returns its sum over ranks in float32, sending half the bytes of
a float32 ring all-reduce. It is Theano-MPI's "asa16" exchanger with the fixes DESIGN.md asks for:

1. scale (fp16 only): every rank takes the same per-bucket scale ``s = LIMIT / (P·amax)``, with
   ``amax`` the largest magnitude of the bucket over all ranks (one 8-byte all-reduce), so no
   scaled value — nor a sum of P of them — exceeds fp16's range, and small gradients keep their
   precision. (An Inf anywhere makes ``amax`` infinite and ``s = 1``; MPI's MAX may drop a NaN.)
   A NaN or Inf reaches every rank's result through the sum itself, which propagates it.
   bf16 has float32's range: it skips this round (s = 1).
2. reduce-scatter: the scaled payload is converted to the wire dtype in one pass and cut into P
   equal segments; an all-to-all gives each rank every rank's copy of its own segment, which it
   sums in float32 (``sum_chunks``) and rounds back to the wire dtype.
3. all-gather of the summed segments, then one pass back to float32 times ``1/s``, into the
   payload itself (``run``) or into a separate array (``sum_into``).

The passes are the kernels' loops on numpy buffers (tf_poseidon/host_kernels.py), into wire
buffers kept between calls: no TensorFlow tensor is made on the engine thread.

Bytes per rank: (P-1)/P·n·2 in each of steps 2 and 3, half of the float32 ring's 2(P-1)/P·n·4.
Open MPI's own float16 reduction is not used: it is slow and accumulates in float16.
"""

from __future__ import annotations

import numpy as np

from tf_poseidon import host_kernels
from tf_poseidon.comm.collectives import Collective, _mpi, summing

FP16_LIMIT = 65504.0 / 4  # headroom below fp16's largest value for the rounding of the sums

WIRE_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def _global_scale(comm, payload: np.ndarray, wire: str) -> float:
    if wire != "fp16" or payload.size == 0:
        return 1.0
    local = np.array([host_kernels.max_abs(payload)])
    comm.Allreduce(_mpi().IN_PLACE, local, op=_mpi().MAX)
    amax = float(local[0])
    if not np.isfinite(amax) or amax == 0.0:
        return 1.0
    return FP16_LIMIT / (comm.Get_size() * amax)


class _Scratch:
    """The wire buffers of one codec, kept between calls (engine thread only) and grown to the
    largest bucket seen: fresh large arrays would page-fault through every call."""

    def __init__(self, dtype: np.dtype):
        self._dtype = dtype
        self._buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, size: int) -> np.ndarray:
        """A 1-D array of ``size`` elements (contents undefined)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.size < size:
            buffer = self._buffers[name] = np.empty(size, self._dtype)
        return buffer[:size]


def compressed_allreduce(compression: str) -> Collective:
    """The compressed sum for ``compression`` ("fp16" or "bf16"); see the module docstring."""
    import tensorflow as tf

    wire = np.dtype(tf.as_dtype(WIRE_DTYPES[compression]).as_numpy_dtype)
    scratch = _Scratch(wire)

    def sum_into(comm, payload: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Sums the float ``payload`` over ranks into ``out`` (which may be ``payload``)."""
        if payload.dtype != np.float32:  # float64 gradients travel as float32 first
            if payload.dtype.kind != "f":
                raise TypeError(f"compression={compression!r} sums floating gradients only, "
                                f"got a {payload.dtype} bucket")
            summed = payload.astype(np.float32)
            out[...] = sum_into(comm, summed, summed)
            return out
        size = comm.Get_size()
        n = payload.size
        segment = -(-n // size)  # ceil: P equal segments, the last one padded
        scale = _global_scale(comm, payload, compression)
        packed = scratch.get("packed", segment * size)
        host_kernels.convert(payload, packed[:n], scale)
        packed[n:] = 0
        mine = scratch.get("mine", segment * size)
        comm.Alltoall(packed.view(np.uint16), mine.view(np.uint16))
        summed = scratch.get("summed", segment)
        host_kernels.sum_chunks(mine.reshape(size, segment), summed)
        gathered = scratch.get("gathered", segment * size)
        comm.Allgather(summed.view(np.uint16), gathered.view(np.uint16))
        host_kernels.convert(gathered[:n], out, 1.0 / scale)
        return out

    def wire_bytes(payload_bytes: int, size: int) -> tuple[float, float]:
        moved = 2 * (size - 1) / size * payload_bytes / 2  # two phases, 16-bit elements
        return moved, moved

    return summing(f"allreduce_{compression}", sum_into, wire_bytes)
