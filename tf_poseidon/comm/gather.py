"""Gathering rows of every rank in rank order.

``strategy.gather``, a replica context's ``all_gather`` and ``predict``'s concatenation of the
ranks' outputs (``reduce_per_replica(..., "concat")``) all come here. Ranks may hold different
numbers of rows (an uneven last batch, a rank with none). The other dimensions may be unknown
when the graph is traced (a sequence model's time steps, which vary from batch to batch): then,
and eagerly, every rank's shape is gathered too and checked, so a tensor's rows arrive whole or
the call fails with a message, never misaligned. Ragged tensors are gathered level by level.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_poseidon.comm import graph_ops
from tf_poseidon.comm.buckets import Bucket, Item
from tf_poseidon.comm.engine import CollectiveGroup, CommEngine
from tf_poseidon.comm.protocol import AllGather


def gather_along(engine: CommEngine, sequencer: graph_ops.Sequencer,
                 value: tf.Tensor | tf.RaggedTensor, axis: int) -> tf.Tensor | tf.RaggedTensor:
    """Every rank's ``value`` concatenated along ``axis`` in rank order.

    A collective: every rank calls it alike (eagerly, or in a traced function where it runs
    when the function runs), and every rank gets the same result; it blocks until every rank's
    part has arrived. ``value``: a dense tensor of any dtype and known rank (a scalar counts as
    one row), or a ``tf.RaggedTensor`` (``axis`` 0 only). Dimensions other than ``axis`` must
    be equal on every rank that has rows along ``axis``; eagerly, and where they are unknown at
    tracing time, they are checked (``tf.errors.InvalidArgumentError`` naming the shapes, on
    every rank).
    The result has the dtype of ``value``; its static shape keeps the dimensions known here.
    """
    if isinstance(value, tf.RaggedTensor):
        if axis != 0:
            raise ValueError(f"tf_poseidon gathers ragged tensors along axis 0 only, got axis "
                             f"{axis} for {value}.")
        return _gather_ragged(engine, sequencer, value)
    tensor = tf.convert_to_tensor(value)
    rank = tensor.shape.rank
    if rank is None:
        raise ValueError(f"tf_poseidon gather needs a tensor of known rank, got {tensor}; "
                         "give it a static rank (tf.ensure_shape) first.")
    if not rank:
        tensor, axis, rank = tf.reshape(tensor, [1]), 0, 1
    axis = axis % rank
    perm = [axis] + [d for d in range(rank) if d != axis]
    moved = tf.transpose(tensor, perm) if axis else tensor
    gathered = gather_rows(engine, sequencer, moved)
    if not axis:
        return gathered
    inverse = [perm.index(d) for d in range(rank)]
    return tf.transpose(gathered, inverse)


def gather_rows(engine: CommEngine, sequencer: graph_ops.Sequencer,
                tensor: tf.Tensor) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along axis 0, in rank order (see
    :func:`gather_along`). In a traced function whose tensor has static dimensions after the
    first, one all-gather: every rank traced the same program, so they agree. Otherwise (unknown
    dimensions, or eagerly, where each rank's shape is its own) two: shapes, then values."""
    inner = tensor.shape[1:]
    if inner.is_fully_defined() and not tf.executing_eagerly():
        return _all_gather(engine, sequencer, "gather", tensor)
    shape = tf.shape(tensor, out_type=tf.int64)
    shapes = _all_gather(engine, sequencer, "gather_shapes", shape[tf.newaxis])
    flat = _all_gather(engine, sequencer, "gather", tf.reshape(tensor, [-1]))
    # Ranks without rows sent nothing; their other dimensions (often 0 then) do not count.
    with_rows = tf.boolean_mask(shapes[:, 1:], shapes[:, 0] > 0)
    inner_shape = tf.cond(tf.size(with_rows) > 0, lambda: with_rows[0], lambda: shape[1:])
    check = tf.debugging.Assert(
        tf.reduce_all(tf.equal(with_rows, inner_shape)),
        ["tf_poseidon gather: the ranks' tensors differ in a dimension other than the gathered "
         "axis; their shapes, rank by rank:", shapes], summarize=64)
    with tf.control_dependencies([check]):
        gathered = tf.reshape(flat, tf.concat([[-1], inner_shape], axis=0))
    gathered.set_shape(tf.TensorShape([None]).concatenate(inner))
    return gathered


_ALL_GATHER = AllGather()


def _all_gather(engine: CommEngine, sequencer: graph_ops.Sequencer, name: str,
                tensor: tf.Tensor) -> tf.Tensor:
    """One all-gather of ``tensor``'s rows (other dimensions static and equal on every rank):
    a one-bucket group of the AllGather protocol."""
    item = Item(name, tuple(tensor.shape.as_list()), np.dtype(tensor.dtype.as_numpy_dtype), 0,
                AllGather.kind)
    group = CollectiveGroup(name, [Bucket(0, AllGather.kind, (0,), (item,), item.payload_dtype)],
                            {AllGather.kind: _ALL_GATHER})
    [gathered] = graph_ops.run_buckets(engine, sequencer, group, [[tensor]])
    return gathered


def _gather_ragged(engine: CommEngine, sequencer: graph_ops.Sequencer,
                   value: tf.RaggedTensor) -> tf.RaggedTensor:
    """Concatenating ragged tensors along axis 0 concatenates their values and, level by
    level, their row lengths."""
    values = gather_rows(engine, sequencer, value.flat_values)
    lengths = [gather_rows(engine, sequencer, level) for level in value.nested_row_lengths()]
    return tf.RaggedTensor.from_nested_row_lengths(values, lengths, validate=False)
