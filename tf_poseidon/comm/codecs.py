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
2. reduce-scatter: the scaled payload is packed to the wire dtype (one fused pass, kernels'
   ``pack``) and cut into P equal segments; an all-to-all gives each rank every rank's copy of
   its own segment, which it sums in float32 (``sum_chunks``) and rounds back to the wire dtype.
3. all-gather of the summed segments, then one fused pass back to float32 times ``1/s``.

Bytes per rank: (P-1)/P·n·2 in each of steps 2 and 3, half of the float32 ring's 2(P-1)/P·n·4.
Open MPI's own float16 reduction is not used: it is slow and accumulates in float16.
"""

from __future__ import annotations

import numpy as np

from tf_poseidon.comm.collectives import Collective, _mpi

FP16_LIMIT = 65504.0 / 4  # headroom below fp16's largest value for the rounding of the sums

WIRE_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def _global_scale(comm, payload: np.ndarray, wire: str) -> float:
    if wire != "fp16" or payload.size == 0:
        return 1.0
    local = np.array([max(float(payload.max()), -float(payload.min()))])
    comm.Allreduce(_mpi().IN_PLACE, local, op=_mpi().MAX)
    amax = float(local[0])
    if not np.isfinite(amax) or amax == 0.0:
        return 1.0
    return FP16_LIMIT / (comm.Get_size() * amax)


def _as_uint16(array: np.ndarray) -> np.ndarray:
    """The bits of a 16-bit float array, which MPI moves as plain 16-bit words."""
    return np.ascontiguousarray(array).view(np.uint16)


def _numpy(tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array, without a copy where dlpack allows it (numpy
    has no bfloat16 dlpack type: those are copied)."""
    try:
        return np.from_dlpack(tensor)
    except (TypeError, BufferError, RuntimeError):
        return tensor.numpy()


def compressed_allreduce(compression: str) -> Collective:
    """The compressed sum for ``compression`` ("fp16" or "bf16"); see the module docstring."""
    import tensorflow as tf

    from tf_poseidon import ops

    wire = tf.as_dtype(WIRE_DTYPES[compression])

    def run(comm, payload: np.ndarray) -> np.ndarray:
        size = comm.Get_size()
        n = payload.size
        segment = -(-n // size)  # ceil
        scale = _global_scale(comm, payload, compression)
        # Explicit conversions: the kernels are fastest on tensors, and dlpack hands their
        # outputs to MPI without copies.
        packed = ops.pack([tf.constant(payload)], wire, scale)
        if segment * size != n:  # padded to P equal segments
            packed = tf.pad(packed, [[0, segment * size - n]])
        mine = np.empty((size, segment), np.uint16)
        comm.Alltoall(_as_uint16(_numpy(packed)).reshape(size, segment), mine)
        summed = ops.sum_chunks(tf.constant(mine.view(wire.as_numpy_dtype)), 1.0, wire)
        gathered = np.empty(segment * size, np.uint16)
        comm.Allgather(_as_uint16(_numpy(summed)), gathered)
        result = ops.unpack(tf.constant(gathered[:n].view(wire.as_numpy_dtype)), [[n]],
                            [tf.float32], 1.0 / scale)[0]
        return _numpy(result)

    def wire_bytes(payload_bytes: int, size: int) -> tuple[float, float]:
        moved = 2 * (size - 1) / size * payload_bytes / 2  # two phases, 16-bit elements
        return moved, moved

    return Collective(f"allreduce_{compression}", run, wire_bytes)
