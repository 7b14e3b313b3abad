"""Buckets: the unit of communication.

A bucket is a set of tensors that travel together in one collective. Gradients are assigned to
buckets in backprop order — the last layer's gradients first, since backprop produces them first
— so bucket 0 is the first one ready and the first one posted. Bucket 0 is kept small so that
communication starts early; the others are capped at ``bucket_bytes`` (PyTorch DDP's scheme).
A tensor larger than the cap gets a bucket of its own; tensors are never split.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import tensorflow as tf

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors ``members`` (positions in the caller's flat list) reduced together.

    ``payload_dtype`` is the numpy dtype the bucket is summed in (float32 for 16- and 32-bit
    floats, float64 for float64, int64 for integers); ``sizes`` are the members' element
    counts in member order.
    """

    index: int
    members: tuple[int, ...]
    sizes: tuple[int, ...]
    payload_dtype: np.dtype

    @property
    def num_elements(self) -> int:
        return sum(self.sizes)

    @property
    def payload_bytes(self) -> int:
        return self.num_elements * self.payload_dtype.itemsize


def member_slices(sizes: Sequence[int]) -> list[slice]:
    """Where each member of ``sizes`` elements lies in the flat payload, in member order."""
    bounds = np.cumsum([0, *sizes])
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def payload_dtype(dtype: tf.DType) -> np.dtype:
    """The dtype a tensor of ``dtype`` is summed in. Raises TypeError for non-numeric dtypes."""
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


def plan_buckets(values: Sequence[tf.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                 backprop_order: bool = True) -> list[Bucket]:
    """Assigns ``values`` to buckets.

    Args:
      values: tensors with static shapes, in forward (variable creation) order.
      bucket_bytes: cap on a bucket's payload bytes (bucket 0 excepted).
      first_bucket_bytes: cap on bucket 0's payload bytes.
      backprop_order: visit ``values`` last-first (gradients); False keeps the given order.

    Returns:
      Buckets, index 0 first. Every position of ``values`` is in exactly one bucket; a bucket
      holds one payload dtype only.
    """
    order = range(len(values) - 1, -1, -1) if backprop_order else range(len(values))
    buckets: list[Bucket] = []
    open_by_dtype: dict[np.dtype, tuple[list[int], list[int]]] = {}

    def close(dtype: np.dtype) -> None:
        members, sizes = open_by_dtype.pop(dtype)
        buckets.append(Bucket(len(buckets), tuple(members), tuple(sizes), dtype))

    for position in order:
        value = values[position]
        dtype = payload_dtype(value.dtype)
        n = static_num_elements(value, f"value {position}")
        cap = first_bucket_bytes if not buckets else bucket_bytes
        if dtype in open_by_dtype:
            members, sizes = open_by_dtype[dtype]
            if (sum(sizes) + n) * dtype.itemsize > cap and members:
                close(dtype)
        members, sizes = open_by_dtype.setdefault(dtype, ([], []))
        members.append(position)
        sizes.append(n)
        if sum(sizes) * dtype.itemsize >= cap:
            close(dtype)
    for dtype in list(open_by_dtype):
        close(dtype)
    return buckets
