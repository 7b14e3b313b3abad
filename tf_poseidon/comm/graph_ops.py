"""The graph side of the engine: ops that hand buckets to it and bring results back.

Per bucket, two ops:

* ``enqueue``: a stateless, non-blocking op. It runs as soon as the bucket's tensors exist,
  copies them into one payload, hands it to the engine and returns a scalar int64 *token*.
* ``collect``: takes *all* tokens of the group as inputs and blocks until the bucket's result
  is there. Because it depends on every token, no inter-op thread blocks before the whole
  group has been handed over — otherwise, with only as many inter-op threads as cores, a rank
  could wait on itself. Its output is the flat reduced payload.

There is deliberately no data or control dependency from one bucket's enqueue to another's, so
TensorFlow runs each as early as its gradients allow (overlap with the rest of backprop). Only
successive *groups* in one graph are chained (a group's enqueues wait for the previous group's
tokens), which is what keeps the group order identical on every rank (see engine.py).
"""

from __future__ import annotations

import weakref
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon.comm import buckets as buckets_lib
from tf_poseidon.comm import engine as engine_lib

# Tokens of the last group traced in each graph; the next group there is chained after them.
_last_tokens: "weakref.WeakKeyDictionary[tf.Graph, list[tf.Tensor]]" = weakref.WeakKeyDictionary()


def _chain_after_previous_group(tokens: list[tf.Tensor] | None) -> list[tf.Tensor]:
    """Returns the previous group's tokens in the current graph and records ``tokens``."""
    if tf.executing_eagerly():
        return []
    graph = tf.compat.v1.get_default_graph()
    previous = _last_tokens.get(graph, [])
    if tokens is not None:
        _last_tokens[graph] = tokens
    return previous


def _enqueue(engine: engine_lib.CommEngine, group: engine_lib.CollectiveGroup,
             bucket: buckets_lib.Bucket, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    dtype = bucket.payload_dtype

    def hand_over(*arrays: np.ndarray) -> np.int64:
        payload = np.empty(bucket.num_elements, dtype)
        offset = 0
        for array in arrays:
            payload[offset:offset + array.size] = array.ravel()
            offset += array.size
        engine.submit(group, bucket.index, payload)
        return np.int64(bucket.index)

    token = tf.numpy_function(hand_over, list(tensors), tf.int64, stateful=False,
                              name=f"tp_enqueue_{group.name}_{bucket.index}")
    token.set_shape([])
    return token


def _collect(group: engine_lib.CollectiveGroup, bucket: buckets_lib.Bucket,
             tokens: Sequence[tf.Tensor], num_elements: int | None) -> tf.Tensor:
    def wait(*_tokens: np.int64) -> np.ndarray:
        return group.wait_result(bucket.index)

    flat = tf.numpy_function(wait, list(tokens), tf.as_dtype(bucket.payload_dtype),
                             stateful=False, name=f"tp_collect_{group.name}_{bucket.index}")
    flat.set_shape([num_elements])
    return flat


RunBucket = Callable[[object, int, np.ndarray], np.ndarray]


def _enqueue_group(engine, name, values, plan, run_bucket, wait_for):
    group = engine_lib.CollectiveGroup(name, len(plan), run_bucket)
    previous = _chain_after_previous_group(None)
    with tf.control_dependencies(list(previous) + list(wait_for)):
        tokens = [_enqueue(engine, group, bucket, [values[i] for i in bucket.members])
                  for bucket in plan]
    _chain_after_previous_group(tokens)
    return group, tokens


def bucketed_collective(engine: engine_lib.CommEngine, name: str,
                        values: Sequence[tf.Tensor], plan: Sequence[buckets_lib.Bucket],
                        run_bucket: RunBucket,
                        wait_for: Sequence[tf.Tensor] = ()) -> list[tf.Tensor]:
    """Runs ``run_bucket`` on every bucket of ``plan`` through the engine.

    Args:
      engine: the process's engine.
      name: names the group in stats, timelines and errors.
      values: tensors with static shapes; ``plan`` assigns each to one bucket.
      plan: from :func:`buckets.plan_buckets`.
      run_bucket: ``(comm, bucket_index, payload) -> result`` run on the engine thread; the
        result has the payload's shape and dtype (e.g. an in-place MPI all-reduce).
      wait_for: tensors every enqueue must wait for (``overlap=False`` passes all gradients
        here, so nothing is sent before the backward pass ends).

    Returns:
      One tensor per value, same shape and dtype, holding that value's part of the results.
      Works eagerly (blocks until done) and in graphs (the collect ops block when run).
    """
    group, tokens = _enqueue_group(engine, name, values, plan, run_bucket, wait_for)
    results: list[tf.Tensor | None] = [None] * len(values)
    for bucket in plan:
        flat = _collect(group, bucket, tokens, bucket.num_elements)
        pieces = tf.split(flat, list(bucket.sizes)) if len(bucket.members) > 1 else [flat]
        for position, piece in zip(bucket.members, pieces):
            value = values[position]
            results[position] = tf.reshape(tf.cast(piece, value.dtype), value.shape)
    return results


def gather_rows(engine: engine_lib.CommEngine, name: str, value: tf.Tensor,
                run_bucket: RunBucket) -> tf.Tensor:
    """Concatenates every rank's ``value`` along axis 0, in rank order.

    ``value`` may have a different leading dimension on each rank; its other dimensions must
    be static and equal on every rank. Eager or graph, like :func:`bucketed_collective`.
    """
    inner = value.shape[1:]
    if not inner.is_fully_defined():
        raise ValueError(f"tf_poseidon gather needs static dimensions after axis 0, got {value.shape}.")
    bucket = buckets_lib.Bucket(0, (0,), (0,), np.dtype(value.dtype.as_numpy_dtype))
    group = engine_lib.CollectiveGroup(name, 1, run_bucket)
    previous = _chain_after_previous_group(None)

    def hand_over(array: np.ndarray) -> np.int64:
        engine.submit(group, 0, np.array(array, copy=True).ravel())
        return np.int64(0)

    with tf.control_dependencies(previous):
        token = tf.numpy_function(hand_over, [value], tf.int64, stateful=False,
                                  name=f"tp_enqueue_{name}")
    _chain_after_previous_group([token])
    flat = _collect(group, bucket, [token], None)
    return tf.reshape(flat, [-1] + inner.as_list())
