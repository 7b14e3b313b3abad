"""Bucket protocols: how one kind of bucket travels, on both sides of the engine.

A :class:`BucketProtocol` is PyTorch DDP's communication hook ``(state, bucket) -> result``
with its graph side attached: the protocol object is the hook's state, and every call gets the
bucket with its identity. For a bucket of its ``kind`` it says

* on a TensorFlow thread, inside the bucket's *enqueue* op (graph_ops.py): ``pack`` — the
  members' input arrays to the payload handed to the engine (a copy: TensorFlow may reuse the
  inputs' memory once the op returns);
* on the engine thread: ``run(comm, call)`` — the collective on that payload, returning a
  :class:`BucketResult`: the value handed back and the bytes it moved (``call`` names the
  group, its instance — which training step —, the bucket and its items);
* on a TensorFlow thread, inside the bucket's *collect* op: ``outputs`` (the op's dtypes and
  static shapes) and ``receive`` — waits for the engine's result and returns the op's outputs;
* in the graph, after the collect op: ``finish`` — each member's result (a tensor, or what the
  caller's algorithm needs: SFB's gathered factors).

``graph_ops.run_buckets`` runs a planned group of buckets with one protocol per kind;
``AllReduce`` (sum, through a codec) and ``AllGather`` (rows of every rank) are here, the other
protocols beside what they serve (tf_poseidon/sfb/protocol.py, algorithms/ssp.py). A new
protocol is one subclass: ``kind``, ``run``, and whichever graph-side methods differ from the
defaults (concatenate the members, one piece per member, reshape to the member's tensor).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon.comm import collectives
from tf_poseidon.comm.buckets import Bucket, aligned_empty, member_slices
from tf_poseidon.comm.codecs import Codec


@dataclasses.dataclass(frozen=True)
class BucketCall:
    """One bucket handed to a protocol on the engine thread, with its identity."""

    group: str  # the group's name ("gradients", "metrics", ...)
    group_id: int
    instance: int  # which execution of the group: 0, 1, ... (the step, for gradients)
    bucket: Bucket
    payload: np.ndarray


@dataclasses.dataclass(frozen=True)
class BucketResult:
    """What a protocol's ``run`` returns: the value its ``receive`` gets (an array, or what
    the protocol's own ``receive`` expects) and what it moved.

    ``item_bytes``, when given, replaces the items' planned payload bytes in the statistics
    (for protocols whose sizes are known only when they run).
    """

    value: Any
    bytes_sent: float
    bytes_received: float
    item_bytes: tuple[int, ...] | None = None


class BucketProtocol:
    """The contract (see the module docstring); the graph-side defaults fit a protocol whose
    payload is its members concatenated and whose result has the payload's layout."""

    kind: str = ""

    def run(self, comm, call: BucketCall) -> BucketResult:
        """Engine thread only: the collective on ``call.payload``; every rank runs it for the
        same bucket in the same order. Blocks until done."""
        raise NotImplementedError

    def pack(self, bucket: Bucket, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """TF thread: the payload of ``arrays`` (the members' inputs, in member order)."""
        payload = aligned_empty(sum(a.size for a in arrays), bucket.payload_dtype)
        if arrays:
            np.concatenate([np.asarray(a, bucket.payload_dtype).ravel() for a in arrays],
                           out=payload)
        return payload

    def outputs(self, bucket: Bucket) -> list[tuple[tf.DType, list]]:
        """The collect op's outputs: (dtype, static shape) each; default one [size] piece per
        member in the payload dtype."""
        dtype = tf.as_dtype(bucket.payload_dtype)
        return [(dtype, [size]) for size in bucket.sizes]

    def receive(self, group, bucket: Bucket) -> list[np.ndarray]:
        """TF thread, inside the collect op: waits for the bucket's next result (at most the
        collective timeout) and returns the op's outputs; default its member pieces."""
        flat = group.wait_result(bucket.index)
        return [flat[part] for part in member_slices(bucket.sizes)]

    def finish(self, bucket: Bucket, outputs: Sequence[tf.Tensor],
               inputs: Sequence[Sequence[tf.Tensor]]) -> list[Any]:
        """Graph: each member's result from the collect op's ``outputs``; ``inputs`` are the
        members' input tensors. Default: each piece as its (first) input's shape and dtype."""
        return [tf.reshape(tf.cast(piece, member[0].dtype), member[0].shape)
                for piece, member in zip(outputs, inputs)]


class AllReduce(BucketProtocol):
    """Sums the bucket over all ranks through ``codec`` (exact, or 16 bits on the wire);
    every rank gets the same sums, in the members' shapes and dtypes."""

    kind = "allreduce"

    def __init__(self, codec: Codec):
        self.codec = codec

    def run(self, comm, call: BucketCall) -> BucketResult:
        payload = call.payload
        self.codec.sum_into(comm, payload, payload)
        return BucketResult(payload, *self.codec.wire_bytes(payload.size, comm.Get_size(),
                                                              payload.dtype))


class AllGather(BucketProtocol):
    """Every rank's one member concatenated along axis 0 in rank order; the leading dimension
    may differ by rank, the others must be static and equal (the bytes reported assume equal
    lengths)."""

    kind = "allgather"

    def run(self, comm, call: BucketCall) -> BucketResult:
        gathered = collectives.allgather_concat(comm, call.payload)
        moved = (comm.Get_size() - 1) * call.payload.nbytes
        return BucketResult(gathered, moved, moved, (call.payload.nbytes,))

    def outputs(self, bucket: Bucket) -> list[tuple[tf.DType, list]]:
        return [(tf.as_dtype(bucket.payload_dtype), [None])]

    def receive(self, group, bucket: Bucket) -> list[np.ndarray]:
        return [group.wait_result(bucket.index)]

    def finish(self, bucket, outputs, inputs) -> list[tf.Tensor]:
        [flat], [[value]] = outputs, inputs
        return [tf.reshape(flat, [-1] + value.shape[1:].as_list())]
