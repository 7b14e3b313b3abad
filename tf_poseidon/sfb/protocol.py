"""The SFB bucket protocol: Dense kernels' sufficient factors gathered, gradients rebuilt.

For a kernel W (M×N) and local batch K, rank p's gradient is U_pᵀV_p with U_p = x_p [K, M] (the
layer's input) and V_p = δ_p [K, N] (the gradient at its output). Instead of summing M·N
numbers, every rank gathers every rank's factors and rebuilds ΔW = Σ_p U_pᵀV_p = UᵀV
(:func:`reconstruct`). An SFB member is an ``Item`` of kind ``"sfb"`` whose shape is (M, N) and
whose inputs are (U, V); it travels in the same bucket stream as the all-reduced gradients, in
backprop order, so wait-free backprop works as for all-reduce alone (a layer's factors exist as
soon as its δ does).

A bucket's payload is float32 ``[K_1..K_L, U_1, V_1, ..., U_L, V_L]`` (the row counts first: K
may differ per rank, e.g. on an uneven last batch). On the engine thread each factor block is
encoded by the strategy's codec (float32, or fp16 with a per-block power-of-two scale, bf16,
or a user's codec) and gathered in two rounds: the fixed-size headers (row counts and the
blocks' codec metadata) by ``Allgather``, then the blocks by ``Allgatherv``. The result handed
back to the graph is float32 ``[R_1..R_L, U_1 stacked, V_1 stacked, ...]`` with R_l = Σ_p K_lp
rows, rank 0's first.

Bytes per rank for a layer (equal K): (P-1)·K·(M+N)·b, b the codec's bytes per element, plus the
header.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon.comm.buckets import Bucket, Item, aligned_empty
from tf_poseidon.comm.codecs import Codec
from tf_poseidon.comm.protocol import BucketCall, BucketProtocol, BucketResult

KIND = "sfb"


def item(name: str, m: int, n: int, rows_estimate: int) -> Item:
    """The bucket item of one kernel's factors: payload about ``rows_estimate``·(M+N)
    float32 values (the plan's K; the real K is known when the step runs)."""
    return Item(name, (m, n), np.dtype(np.float32), rows_estimate * (m + n), KIND)


@dataclasses.dataclass(frozen=True)
class GatheredFactors:
    """Every rank's factors of one layer, stacked in rank order: U [R, M], V [R, N]."""

    u: tf.Tensor
    v: tf.Tensor


class SfbProtocol(BucketProtocol):
    """The protocol of ``"sfb"`` buckets (module docstring); ``codec`` encodes the factors."""

    kind = KIND

    def __init__(self, codec: Codec):
        self.codec = codec

    # -- graph side ------------------------------------------------------------------------

    def pack(self, bucket: Bucket, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """``arrays`` are U_1, V_1, U_2, V_2, ...: the payload with their row counts first."""
        rows = [a.shape[0] for a in arrays[::2]]
        payload = aligned_empty(len(rows) + sum(a.size for a in arrays), np.float32)
        payload[:len(rows)] = rows
        at = len(rows)
        for array in arrays:
            payload[at:at + array.size] = array.ravel()
            at += array.size
        return payload

    def outputs(self, bucket: Bucket) -> list[tuple[tf.DType, list]]:
        return [(tf.float32, [None])]

    def receive(self, group, bucket: Bucket) -> list[np.ndarray]:
        return [group.wait_result(bucket.index)]

    def finish(self, bucket: Bucket, outputs: Sequence[tf.Tensor],
               inputs: Sequence[Sequence[tf.Tensor]]) -> list[GatheredFactors]:
        [flat] = outputs
        shapes = [it.shape for it in bucket.items]
        count = len(shapes)
        totals = tf.cast(flat[:count], tf.int32)
        sizes = []
        for j, (m, n) in enumerate(shapes):
            sizes += [totals[j] * m, totals[j] * n]
        parts = tf.split(flat[count:], tf.stack(sizes), num=2 * count)
        return [GatheredFactors(tf.reshape(parts[2 * j], [-1, m]),
                                tf.reshape(parts[2 * j + 1], [-1, n]))
                for j, (m, n) in enumerate(shapes)]

    # -- engine side -----------------------------------------------------------------------

    def run(self, comm, call: BucketCall) -> BucketResult:
        size, rank = comm.Get_size(), comm.Get_rank()
        shapes = [it.shape for it in call.bucket.items]
        count = len(shapes)
        payload = np.asarray(call.payload, np.float32)
        rows = payload[:count].astype(np.int64)
        blocks, offset = [], count
        for (m, n), k in zip(shapes, rows):
            for width in (m, n):
                blocks.append(payload[offset:offset + k * width])
                offset += k * width
        wire = np.dtype(self.codec.wire_dtype)
        body = np.empty(sum(b.size for b in blocks), wire)
        metas, at = [], 0
        for block in blocks:
            metas.append(np.asarray(self.codec.encode(block, body[at:at + block.size]),
                                    np.float64).reshape(self.codec.meta_size))
            at += block.size
        header = np.concatenate([rows.astype(np.float64), *metas])
        headers = np.empty((size, header.size), np.float64)
        comm.Allgather(header, headers)
        all_rows = headers[:, :count].astype(np.int64)  # [P, L]
        all_metas = headers[:, count:].reshape(size, 2 * count, self.codec.meta_size)
        widths = np.array([w for m, n in shapes for w in (m, n)], np.int64)
        counts = (np.repeat(all_rows, 2, axis=1) * widths).sum(axis=1)  # elements per rank
        gathered = np.empty(int(counts.sum()), wire)
        displacements = np.concatenate([[0], np.cumsum(counts)[:-1]])
        comm.Allgatherv(body.view(np.uint8), [gathered.view(np.uint8),
                                              (counts * wire.itemsize,
                                               displacements * wire.itemsize)])
        result = self._assemble(shapes, gathered, all_rows, all_metas, displacements)
        others = float((counts.sum() - counts[rank]) * wire.itemsize
                       + (size - 1) * header.nbytes)
        item_bytes = tuple(int(all_rows[rank, layer]) * (m + n) * 4
                           for layer, (m, n) in enumerate(shapes))
        return BucketResult(result, others, others, item_bytes)

    def _assemble(self, shapes, gathered: np.ndarray, all_rows: np.ndarray,
                  all_metas: np.ndarray, displacements: np.ndarray) -> np.ndarray:
        """The result: summed row counts, then each layer's U and V of every rank stacked."""
        size, count = all_rows.shape
        widths = [w for m, n in shapes for w in (m, n)]
        out = np.empty(count + int((np.repeat(all_rows, 2, axis=1) * widths).sum()),
                       np.float32)
        out[:count] = all_rows.sum(axis=0)
        # Where each rank's blocks start in its segment: [U_1, V_1, U_2, V_2, ...].
        starts = np.empty((size, 2 * count), np.int64)
        for p in range(size):
            at = displacements[p]
            for block, width in enumerate(widths):
                starts[p, block] = at
                at += all_rows[p, block // 2] * width
        at = count
        for block, width in enumerate(widths):
            for p in range(size):
                length = all_rows[p, block // 2] * width
                self.codec.decode(gathered[starts[p, block]:starts[p, block] + length],
                                  all_metas[p, block], out[at:at + length])
                at += length
        return out


def reconstruct(gathered: GatheredFactors, shape: tf.TensorShape, dtype: tf.DType,
                scale: tf.Tensor | float = 1.0) -> tf.Tensor:
    """ΔW = scale·Σ_p U_pᵀ V_p (``ops.sfb_reconstruct``, float32 accumulation), as ``dtype``."""
    from tf_poseidon import ops
    result = ops.sfb_reconstruct(gathered.u, gathered.v, scale)
    return tf.cast(tf.reshape(result, shape), dtype)
