"""The sparse-rows bucket protocol: embedding gradients as (indices, rows), gathered.

An embedding lookup's gradient is a ``tf.IndexedSlices``: one row per lookup (duplicates
included) with the index it belongs to. Summing it densely moves the whole table; gathering
every rank's (indices, rows) moves only what the step touched. Concatenated in rank order —
rank r holds rows [⌊n·r/P⌋, ⌊n·(r+1)/P⌋) of the global batch — they are exactly the
``IndexedSlices`` one process computes for the whole batch, so the optimizer applies them as
it would there: Keras' TensorFlow optimizers scatter one update per occurrence, which a dense
sum would change. A member is an ``Item`` of kind ``"sparse"`` whose shape is the table's
(rows, width) and whose inputs are (indices, values [k, width]).

Payload (bytes): per member an int64 row count k, int64 indices [k], float32 values [k·width].
On the engine thread the values are encoded by the strategy's codec; a fixed-size header (row
counts and codec metadata, float64) is gathered first, then the indices and encoded rows with
``Allgatherv``. Bytes per rank: (P-1)·k·(width·b + 8) plus the header.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon.comm.buckets import Bucket, Item
from tf_poseidon.comm.codecs import Codec
from tf_poseidon.comm.protocol import BucketCall, BucketProtocol, BucketResult

KIND = "sparse"


def item(name: str, rows: int, width: int, lookups_estimate: int) -> Item:
    """The bucket item of one table's sparse gradient (payload bytes estimated from the plan's
    lookups per step)."""
    return Item(name, (rows, width), np.dtype(np.uint8), lookups_estimate * (8 + 4 * width),
                KIND)


def inputs_of(grad: tf.IndexedSlices, width: int) -> list[tf.Tensor]:
    """The member inputs of ``grad``: int64 indices [k] and float32 values [k, width]."""
    return [tf.cast(grad.indices, tf.int64),
            tf.reshape(tf.cast(grad.values, tf.float32), [-1, width])]


class SparseProtocol(BucketProtocol):
    """The protocol of ``"sparse"`` buckets (module docstring); ``codec`` encodes the rows."""

    kind = KIND

    def __init__(self, codec: Codec):
        self.codec = codec

    # -- graph side ------------------------------------------------------------------------

    def pack(self, bucket: Bucket, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """``arrays`` are indices, values of each member in turn."""
        parts = []
        for indices, values in zip(arrays[::2], arrays[1::2]):
            parts += [np.array([indices.size], np.int64).view(np.uint8),
                      np.ascontiguousarray(indices, np.int64).view(np.uint8).ravel(),
                      np.ascontiguousarray(values, np.float32).view(np.uint8).ravel()]
        return np.concatenate(parts) if parts else np.empty(0, np.uint8)

    def outputs(self, bucket: Bucket) -> list[tuple[tf.DType, list]]:
        return [spec for _ in bucket.items for spec in ((tf.int64, [None]),
                                                         (tf.float32, [None]))]

    def receive(self, group, bucket: Bucket) -> list[np.ndarray]:
        return group.wait_result(bucket.index)

    def finish(self, bucket: Bucket, outputs: Sequence[tf.Tensor],
               inputs: Sequence[Sequence[tf.Tensor]]) -> list[tf.IndexedSlices]:
        """Each member's gathered rows, every rank's in rank order, as IndexedSlices (float32
        values; the caller casts)."""
        return [tf.IndexedSlices(tf.reshape(values, [-1, it.shape[1]]), indices,
                                 tf.constant(it.shape, tf.int64))
                for it, indices, values in zip(bucket.items, outputs[::2], outputs[1::2])]

    # -- engine side -----------------------------------------------------------------------

    def run(self, comm, call: BucketCall) -> BucketResult:
        size, rank = comm.Get_size(), comm.Get_rank()
        widths = [it.shape[1] for it in call.bucket.items]
        count = len(widths)
        members = _parse(call.payload, widths)
        wire = np.dtype(self.codec.wire_dtype)
        bodies, metas = [], []
        for indices, values in members:
            encoded = np.empty(values.size, wire)
            metas.append(np.asarray(self.codec.encode(values, encoded), np.float64)
                         .reshape(self.codec.meta_size))
            bodies += [indices.view(np.uint8), encoded.view(np.uint8)]
        header = np.concatenate([[float(i.size) for i, _ in members], *metas])
        headers = np.empty((size, header.size), np.float64)
        comm.Allgather(header, headers)
        all_rows = headers[:, :count].astype(np.int64)  # [P, L]
        all_metas = headers[:, count:].reshape(size, count, self.codec.meta_size)
        per_rank = (all_rows * (8 + np.array(widths) * wire.itemsize)).sum(axis=1)
        body = np.concatenate(bodies) if bodies else np.empty(0, np.uint8)
        gathered = np.empty(int(per_rank.sum()), np.uint8)
        displacements = np.concatenate([[0], np.cumsum(per_rank)[:-1]])
        comm.Allgatherv(body, [gathered, (per_rank, displacements)])
        outputs = []
        for layer, width in enumerate(widths):
            total = int(all_rows[:, layer].sum())
            indices, values = np.empty(total, np.int64), np.empty(total * width, np.float32)
            at = 0
            for p in range(size):
                start = displacements[p] + int(
                    (all_rows[p, :layer] * (8 + np.array(widths[:layer]) * wire.itemsize)).sum())
                k = all_rows[p, layer]
                indices[at:at + k] = gathered[start:start + 8 * k].view(np.int64)
                encoded = gathered[start + 8 * k:start + k * (8 + width * wire.itemsize)]
                self.codec.decode(encoded.view(wire), all_metas[p, layer],
                                  values[at * width:(at + k) * width])
                at += k
            outputs += [indices, values]
        others = float(per_rank.sum() - per_rank[rank] + (size - 1) * header.nbytes)
        return BucketResult(outputs, others, others,
                            tuple(int(all_rows[rank, layer]) * (8 + 4 * width)
                                  for layer, width in enumerate(widths)))


def _parse(payload: np.ndarray, widths: Sequence[int]) -> list[tuple[np.ndarray, Any]]:
    """The (indices int64, values float32) of each member of a packed payload."""
    members, at = [], 0
    for width in widths:
        k = int(payload[at:at + 8].view(np.int64)[0])
        at += 8
        indices = payload[at:at + 8 * k].view(np.int64)
        at += 8 * k
        values = payload[at:at + 4 * k * width].view(np.float32)
        at += 4 * k * width
        members.append((indices, values))
    return members
