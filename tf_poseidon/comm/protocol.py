"""Bucket protocols: how one kind of bucket travels, on both sides of the engine.

A :class:`BucketProtocol` is PyTorch DDP's communication hook ``(state, bucket) -> result``
with its graph side attached: the protocol object is the hook's state, and every call gets the
bucket with its identity. For a bucket of its ``kind`` it says

* in the graph, when the step is traced: ``graph_side`` — which protocol object's graph side
  (the methods below but ``run``) carries the bucket in this trace, from the members' input
  tensors (default: itself; an all-reduce bucket of tensors on a GPU: ``DevicePacked``), and
  that one's ``stage`` — the enqueue op's inputs, made from the members' tensors on their
  device (default: the tensors themselves);
* on a TensorFlow thread, inside the bucket's *enqueue* op (graph_ops.py): ``pack`` — the
  values of those inputs to the payload handed to the engine (a copy: TensorFlow may reuse the
  inputs' memory once the op returns);
* on the engine thread: ``run(comm, call)`` — the collective on that payload, returning a
  :class:`BucketResult`: the value handed back and the bytes it moved (``call`` names the
  group, its instance — which training step —, the bucket and its items);
* on a TensorFlow thread, inside the bucket's *collect* op: ``outputs`` (the op's dtypes and
  static shapes) and ``receive`` — waits for the engine's result and returns the op's outputs;
* in the graph, after the collect op: ``finish`` — each member's result (a tensor, or what the
  caller's algorithm needs: SFB's gathered factors).

``graph_ops.run_buckets`` runs a planned group of buckets with one protocol per kind;
``AllReduce`` (sum, through a codec) with its device form ``DevicePacked`` (comm/datapath.py
says when each is used) and ``AllGather`` (rows of every rank) are here, the other protocols
beside what they serve (tf_poseidon/sfb/protocol.py, algorithms/ssp.py). A new protocol is one
subclass: ``kind``, ``run``, and whichever graph-side methods differ from the defaults (the
members' tensors as they are, concatenated on the host, one piece per member, reshaped to the
member's tensor).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon import ops
from tf_poseidon.comm import collectives, datapath
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
    codec: Codec | None = None  # the autotuner's codec for this bucket (comm/autotune.py)


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

    def graph_side(self, bucket: Bucket, tensors: Sequence[tf.Tensor]) -> "BucketProtocol":
        """Trace time: the protocol whose graph side (``stage``, ``pack``, ``outputs``,
        ``receive``, ``finish``) carries ``bucket`` in this trace, given the members' input
        ``tensors`` (member order); default ``self``. The engine runs the bucket with the
        group's protocol for its kind whatever this returns, so that protocol's ``run`` must
        take the payload of every graph side it hands out."""
        return self

    def stage(self, bucket: Bucket, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Graph, beside the members' tensors (on their device): the enqueue op's inputs,
        which TensorFlow copies to host memory for it; default the tensors themselves."""
        return list(tensors)

    def pack(self, bucket: Bucket, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """TF thread: the payload of ``arrays`` (the values of ``stage``'s tensors; by default
        the members' inputs, in member order), concatenated in the bucket's payload dtype."""
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
    every rank gets the same sums, in the members' shapes and dtypes.

    Its graph side (the host form) packs the members on the host; ``graph_side`` hands a
    bucket of tensors on a GPU (or every float bucket, with ``TF_POSEIDON_DEVICE_PACK=1``) to
    ``DevicePacked``, which packs them on their device (comm/datapath.py). The same bits
    travel either way.
    """

    kind = "allreduce"

    def __init__(self, codec: Codec):
        self.codec = codec

    def graph_side(self, bucket: Bucket, tensors: Sequence[tf.Tensor]) -> BucketProtocol:
        return DevicePacked(self.codec) if datapath.packs_on_device(tensors) else self

    def run(self, comm, call: BucketCall) -> BucketResult:
        """Engine thread: sums ``call.payload`` in place — the members' values in the bucket's
        payload dtype (host form) or in the codec's ``pack_dtype`` (device form) — through
        ``call.codec`` if the autotuner chose one, else the protocol's, and hands back the sums
        in that dtype."""
        payload, codec = call.payload, self.codec
        if call.codec is not None and payload.dtype in (np.float32, np.float64):
            codec = call.codec  # not for a payload packed in 16 bits on its device
        codec.sum_into(comm, payload, payload)
        sent = codec.wire_bytes(payload.size, comm.Get_size(), payload.dtype)
        return BucketResult(payload, *sent,
                            tuple(n * payload.itemsize for n in call.bucket.sizes))


class DevicePacked(AllReduce):
    """The device form of an all-reduce bucket's graph side (comm/datapath.py).

    ``stage``: ``ops.pack`` of the members into one 1-D buffer of the codec's ``pack_dtype``
    (float32; bfloat16 for ``compression="bf16"``, the cast fused into the pack), placed with
    the members (the replica's device), the enqueue op's only input: TensorFlow copies it to
    host memory once. The collect op returns the summed buffer, in the same dtype, as one
    tensor, and ``finish`` unpacks it with ``ops.unpack`` into the members' shapes and dtypes,
    in the graph, so on the device again. Members must be float32, float16 or bfloat16 (what
    ``ops.pack`` takes). Used as a group's protocol itself, it packs every bucket so.
    """

    def graph_side(self, bucket: Bucket, tensors: Sequence[tf.Tensor]) -> BucketProtocol:
        return self

    def stage(self, bucket: Bucket, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        return [ops.pack(tensors, tf.as_dtype(self.codec.pack_dtype))]

    def pack(self, bucket: Bucket, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """TF thread: a copy of the packed buffer as it is (no conversion)."""
        [packed] = arrays
        payload = aligned_empty(packed.size, packed.dtype)
        payload[...] = packed
        return payload

    def outputs(self, bucket: Bucket) -> list[tuple[tf.DType, list]]:
        return [(tf.as_dtype(self.codec.pack_dtype), [bucket.num_elements])]

    def receive(self, group, bucket: Bucket) -> list[np.ndarray]:
        return [group.wait_result(bucket.index)]

    def finish(self, bucket: Bucket, outputs: Sequence[tf.Tensor],
               inputs: Sequence[Sequence[tf.Tensor]]) -> list[tf.Tensor]:
        [flat] = outputs
        return ops.unpack(flat, [member[0].shape for member in inputs],
                          [member[0].dtype for member in inputs])


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
