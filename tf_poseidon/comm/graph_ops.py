"""The graph side of the engine: ops that hand buckets to it and bring results back.

Per bucket, two ops:

* ``enqueue``: a non-blocking op. It runs as soon as the bucket's tensors exist (and the
  previous bucket was handed over), copies them into one payload, hands it to the engine and
  returns a scalar int64 *token*.
* ``collect``: takes *all* tokens of the group as inputs and blocks until the bucket's result
  is there. Because it depends on every token, no inter-op thread blocks before the whole
  group has been handed over — otherwise, with only as many inter-op threads as cores, a rank
  could wait on itself. Its output is the flat reduced payload.

Both are *stateful* ``numpy_function`` ops, so tf.function's automatic control dependencies run
them in creation order. We create them in posting order — a group's enqueues bucket 0 first
(the last layer's gradients, which backprop produces first), then its collects — so the chain
never delays a bucket behind one that becomes ready later, and successive collective calls of one
function (gradients, then metrics, then a user's reduce) reach the engine in the same order on
every rank, even across nested functions and conditionals, which are stateful call ops chained
the same way. (Stateless ops would also let grappler constant-fold an enqueue whose inputs are
constant, e.g. on an empty batch.) Nothing links a bucket's enqueue to the backward pass of
earlier layers, so communication of bucket k overlaps backprop of the layers below it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon.comm import buckets as buckets_lib
from tf_poseidon.comm import engine as engine_lib
from tf_poseidon.comm.collectives import Collective


def _enqueue(engine: engine_lib.CommEngine, group: engine_lib.CollectiveGroup, index: int,
             tensors: Sequence[tf.Tensor], payload_dtype: np.dtype) -> tf.Tensor:
    def hand_over(*arrays: np.ndarray) -> np.int64:
        # A copy: TensorFlow may reuse the arrays' memory once this op returns.
        payload = np.concatenate([np.asarray(a, payload_dtype).ravel() for a in arrays])
        engine.submit(group, index, payload)
        return np.int64(index)

    token = tf.numpy_function(hand_over, list(tensors), tf.int64, stateful=True,
                              name=f"tp_enqueue_{group.name}_{index}")
    token.set_shape([])
    return token


def _collect(group: engine_lib.CollectiveGroup, index: int, tokens: Sequence[tf.Tensor],
             payload_dtype: np.dtype, num_elements: int | None) -> tf.Tensor:
    def wait(*_tokens: np.int64) -> np.ndarray:
        return group.wait_result(index)

    flat = tf.numpy_function(wait, list(tokens), tf.as_dtype(payload_dtype), stateful=True,
                             name=f"tp_collect_{group.name}_{index}")
    flat.set_shape([num_elements])
    return flat


def bucketed_collective(engine: engine_lib.CommEngine, name: str,
                        values: Sequence[tf.Tensor], plan: Sequence[buckets_lib.Bucket],
                        collective: Collective, names: Sequence[str] | None = None,
                        wait_for: Sequence[tf.Tensor] = ()) -> list[tf.Tensor]:
    """Runs ``collective`` on every bucket of ``plan`` through the engine.

    Args:
      engine: the process's engine.
      name: names the group in stats, timelines and errors.
      values: tensors with static shapes; ``plan`` assigns each to one bucket.
      plan: from :func:`buckets.plan_buckets`.
      collective: run on the engine thread per bucket; its result has the payload's shape
        and dtype (e.g. an in-place MPI all-reduce).
      names: one per value, for per-layer statistics (default: positions).
      wait_for: tensors every enqueue must wait for (``overlap=False`` passes all gradients
        here, so nothing is sent before the backward pass ends).

    Returns:
      One tensor per value, same shape and dtype, holding that value's part of the results.
      Works eagerly (blocks until done) and in graphs (the collect ops block when run).
    """
    names = list(names) if names is not None else [str(i) for i in range(len(values))]
    layers = [[(names[i], n * b.payload_dtype.itemsize) for i, n in zip(b.members, b.sizes)]
              for b in plan]
    group = engine_lib.CollectiveGroup(name, collective, layers)
    with tf.control_dependencies(list(wait_for)):
        tokens = [_enqueue(engine, group, b.index, [values[i] for i in b.members],
                           b.payload_dtype) for b in plan]
    results: list[tf.Tensor | None] = [None] * len(values)
    for bucket in plan:
        flat = _collect(group, bucket.index, tokens, bucket.payload_dtype, bucket.num_elements)
        pieces = tf.split(flat, list(bucket.sizes)) if len(bucket.members) > 1 else [flat]
        for position, piece in zip(bucket.members, pieces):
            value = values[position]
            results[position] = tf.reshape(tf.cast(piece, value.dtype), value.shape)
    return results


def gather_rows(engine: engine_lib.CommEngine, name: str, value: tf.Tensor,
                collective: Collective) -> tf.Tensor:
    """Concatenates every rank's ``value`` along axis 0, in rank order.

    ``value`` may have a different leading dimension on each rank; its other dimensions must
    be static and equal on every rank. Eager or graph, like :func:`bucketed_collective`.
    """
    inner = value.shape[1:]
    if not inner.is_fully_defined():
        raise ValueError(f"tf_poseidon gather needs static dimensions after axis 0, got {value.shape}.")
    dtype = np.dtype(value.dtype.as_numpy_dtype)
    group = engine_lib.CollectiveGroup(name, collective, [[(name, 0)]])
    token = _enqueue(engine, group, 0, [value], dtype)
    flat = _collect(group, 0, [token], dtype, None)
    return tf.reshape(flat, [-1] + inner.as_list())
