"""Buckets: the unit of communication, and the one planner that forms them.

A bucket is a set of *items* that travel together in one collective, by one protocol (its
*kind*: "allreduce", "sfb", ...; comm/protocol.py). Gradients are assigned to buckets in
backprop order — the last layer's gradients first, since backprop produces them first — so
bucket 0 is the first one ready and the first one posted. Bucket 0 is kept small so that
communication starts early; the others are capped at ``bucket_bytes`` (PyTorch DDP's scheme).
An item larger than the cap gets a bucket of its own; items are never split, and a bucket holds
items of one kind and one payload dtype only.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

import numpy as np
import tensorflow as tf

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 256 * 1024
ALLREDUCE = "allreduce"


@dataclasses.dataclass(frozen=True)
class Item:
    """One thing a bucket carries: what it stands for and how big its payload is.

    ``shape`` is the shape of the tensor it stands for (a gradient: its variable's), which a
    protocol may need (SFB: the kernel's M×N). ``num_elements`` is its payload's element count
    in ``payload_dtype`` — an estimate for protocols whose payload size is known only when the
    step runs (SFB's factors), used for the bucket caps and the statistics.
    """

    name: str
    shape: tuple[int, ...]
    payload_dtype: np.dtype
    num_elements: int
    kind: str = ALLREDUCE

    @classmethod
    def of(cls, value: tf.Tensor, name: str, kind: str = ALLREDUCE) -> "Item":
        """The item of a tensor with a static shape, summed in its :func:`payload_dtype`."""
        return cls(name, tuple(value.shape.as_list()) if value.shape.rank is not None else (),
                   payload_dtype(value.dtype), static_num_elements(value, name), kind)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Bucket ``index`` of a plan: ``items`` travel together by the protocol ``kind``.

    ``members`` are the items' positions in the caller's list, in bucket order.
    """

    index: int
    kind: str
    members: tuple[int, ...]
    items: tuple[Item, ...]
    payload_dtype: np.dtype

    @property
    def sizes(self) -> tuple[int, ...]:
        """The items' payload element counts, in member order."""
        return tuple(item.num_elements for item in self.items)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(item.name for item in self.items)

    @property
    def num_elements(self) -> int:
        return sum(self.sizes)

    @property
    def payload_bytes(self) -> int:
        return self.num_elements * self.payload_dtype.itemsize


TENSOR_ALIGNMENT = 64  # bytes; TensorFlow's EIGEN_MAX_ALIGN_BYTES on CPUs with AVX-512


def aligned_empty(size: int, dtype: np.dtype) -> np.ndarray:
    """A new 1-D array (contents undefined) whose data starts on a 64-byte boundary (unless
    empty).

    A numpy_function op's output array becomes its tensor without a copy only when so aligned
    (TensorFlow copies others: one more pass over the data). Payloads and results use these.
    """
    dtype = np.dtype(dtype)
    raw = np.empty(size * dtype.itemsize + TENSOR_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % TENSOR_ALIGNMENT
    return raw[start:start + size * dtype.itemsize].view(dtype)


def member_slices(sizes: Sequence[int], aligned_for: np.dtype | None = None) -> list[slice]:
    """Where each member of ``sizes`` elements lies in the flat payload, in member order: one
    after the other, or with ``aligned_for`` (the payload's dtype) each on a TENSOR_ALIGNMENT
    boundary of an aligned payload, so that a piece handed to TensorFlow is not copied (the
    payload then has ``slices[-1].stop`` elements, the gaps unused)."""
    step = 1 if aligned_for is None else max(1, TENSOR_ALIGNMENT // np.dtype(aligned_for).itemsize)
    slices, start = [], 0
    for size in sizes:
        slices.append(slice(start, start + int(size)))
        start += -(-int(size) // step) * step
    return slices


def payload_dtype(dtype: tf.DType) -> np.dtype:
    """The dtype a tensor of ``dtype`` is summed in (float32 for 16- and 32-bit floats, float64
    for float64, int64 for integers). Raises TypeError for non-numeric dtypes."""
    if dtype.is_floating:
        return np.dtype(np.float64 if dtype == tf.float64 else np.float32)
    if dtype.is_integer:
        return np.dtype(np.int64)
    raise TypeError(f"tf_poseidon cannot all-reduce tensors of dtype {dtype.name}; "
                    "only floating and integer tensors can be summed.")


def static_num_elements(value: tf.Tensor, what: str = "tensor") -> int:
    """The element count of ``value``; raises ValueError if its shape is not fully static."""
    if not value.shape.is_fully_defined():
        raise ValueError(
            f"tf_poseidon needs a fully defined shape to plan buckets, but {what} has shape "
            f"{value.shape}. Gradients of variables always have static shapes; for other "
            "values of varying size use strategy.gather instead of all_reduce.")
    return value.shape.num_elements()


def plan_buckets(entries: Sequence[Union[Item, tf.Tensor]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                 backprop_order: bool = True) -> list[Bucket]:
    """Assigns ``entries`` to buckets.

    Args:
      entries: Items, or tensors with static shapes (all-reduce items named by position), in
        forward (variable creation) order.
      bucket_bytes: cap on a bucket's payload bytes (bucket 0 excepted).
      first_bucket_bytes: cap on bucket 0's payload bytes.
      backprop_order: visit ``entries`` last-first (gradients); False keeps the given order.

    Returns:
      Buckets, index 0 first. Every position of ``entries`` is in exactly one bucket; a bucket
      holds one kind and one payload dtype only. Any thread, no communication.
    """
    items = [entry if isinstance(entry, Item) else Item.of(entry, str(position))
             for position, entry in enumerate(entries)]
    order = range(len(items) - 1, -1, -1) if backprop_order else range(len(items))
    buckets: list[Bucket] = []
    open_buckets: dict[tuple[str, np.dtype], list[int]] = {}

    def close(key: tuple[str, np.dtype]) -> None:
        members = open_buckets.pop(key)
        buckets.append(Bucket(len(buckets), key[0], tuple(members),
                              tuple(items[i] for i in members), key[1]))

    def payload_bytes(members: list[int], dtype: np.dtype) -> int:
        return sum(items[i].num_elements for i in members) * dtype.itemsize

    for position in order:
        item = items[position]
        key = (item.kind, item.payload_dtype)
        cap = first_bucket_bytes if not buckets else bucket_bytes
        members = open_buckets.get(key)
        if members and payload_bytes(members + [position], key[1]) > cap:
            close(key)
        members = open_buckets.setdefault(key, [])
        members.append(position)
        if payload_bytes(members, key[1]) >= cap:
            close(key)
    for key in list(open_buckets):
        close(key)
    return buckets
