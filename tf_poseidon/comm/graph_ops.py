"""The graph side of the engine: ops that hand buckets to it and bring results back.

Per bucket, two ops:

* ``enqueue``: a non-blocking op. It runs as soon as the bucket's tensors exist (and the
  previous bucket was handed over), copies them into one payload, hands it to the engine and
  returns a scalar int64 *token*.
* ``collect``: takes *all* tokens of the group as inputs and blocks until the bucket's result
  is there. Because it depends on every token, no inter-op thread blocks before the whole
  group has been handed over — otherwise, with only as many inter-op threads as cores, a rank
  could wait on itself. Its outputs are the result's pieces, one per tensor of the bucket.

Both are stateful ``numpy_function`` ops (grappler may not constant-fold or merge them) and
both go through the :class:`Sequencer`, which runs every communication op of a function in
creation order. We create them in posting order — a group's enqueues bucket 0 first (the last
layer's gradients, which backprop produces first), then its collects — so the order never delays
a bucket behind one that becomes ready later, and successive collective calls of one function
(gradients, then metrics, then a user's reduce) reach the engine in the same order on every
rank, also when some of them sit in a conditional or a loop (LossScaleOptimizer applies the
gradients in a ``tf.cond``; ``steps_per_execution`` runs steps in a ``tf.while_loop``).
Nothing links a bucket's enqueue to the backward pass of earlier layers, so communication of
bucket k overlaps backprop of the layers below it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon.comm import buckets as buckets_lib
from tf_poseidon.comm import engine as engine_lib
from tf_poseidon.comm.collectives import Collective


class Sequencer:
    """Makes a process's communication ops run in the order they were created, in any graph.

    tf.function's automatic control dependencies order stateful ops by creation only among ops
    that touch the same resource (and stateful ops without resources, except that a conditional
    or loop op holding them counts as touching its captured resources instead). So every
    communication op here reads a counter variable before it runs and increments it after:
    the next one's read waits for that increment, and a ``tf.cond`` or ``tf.while_loop`` holding
    communication ops captures the counter and is ordered with the rest. Create it outside any
    strategy scope (it is the process's, not a model's, variable).
    """

    def __init__(self):
        self._counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="tp_comm_order")

    def run_in_order(self, make_op) -> tf.Tensor:
        """``make_op(extra_inputs)`` builds the op; in a graph, ``extra_inputs`` is the counter
        read it must consume (as an ignored input), eagerly it is empty (ops run when built)."""
        if tf.executing_eagerly():
            return make_op([])
        turn = self._counter.read_value()
        op = make_op([turn])
        with tf.control_dependencies([op]):
            self._counter.assign_add(1)
        return op


Pack = Callable[[Sequence[np.ndarray]], np.ndarray]
Wait = Callable[[int], np.ndarray]


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


def concatenated(dtype: np.dtype) -> Pack:
    """The default payload: the tensors flattened and concatenated in ``dtype`` (a copy:
    TensorFlow may reuse the arrays' memory once the enqueue op returns)."""
    def pack(arrays: Sequence[np.ndarray]) -> np.ndarray:
        payload = aligned_empty(sum(a.size for a in arrays), dtype)
        np.concatenate([np.asarray(a, dtype).ravel() for a in arrays], out=payload)
        return payload
    return pack


def enqueue(engine: engine_lib.CommEngine, group: engine_lib.CollectiveGroup, index: int,
            tensors: Sequence[tf.Tensor], sequencer: Sequencer, pack: Pack) -> tf.Tensor:
    """The op that hands bucket ``index``'s payload, ``pack(values of tensors)``, to the
    engine. ``pack`` runs on a TensorFlow thread and must not return memory of its inputs.
    Returns the op's token."""
    count = len(tensors)

    def hand_over(*arrays: np.ndarray) -> np.int64:
        engine.submit(group, index, pack(arrays[:count]))
        return np.int64(index)

    def make(extra):
        token = tf.numpy_function(hand_over, list(tensors) + extra, tf.int64, stateful=True,
                                  name=f"tp_enqueue_{group.name}_{index}")
        token.set_shape([])
        return token
    return sequencer.run_in_order(make)


def collect(group: engine_lib.CollectiveGroup, index: int, tokens: Sequence[tf.Tensor],
            payload_dtype: np.dtype, sizes: Sequence[int] | None,
            sequencer: Sequencer, wait: Wait | None = None) -> list[tf.Tensor]:
    """The op that waits for bucket ``index``'s result (``wait(index)``, default the group's
    next result) once every token exists. Returns the result cut into 1-D pieces of ``sizes``
    elements (outputs of the op itself: no split copies it again), or, with ``sizes=None``,
    the whole result of any length as one piece."""
    wait = wait or group.wait_result
    parts = buckets_lib.member_slices(sizes) if sizes is not None else [slice(None)]

    def result(*_inputs) -> list[np.ndarray]:
        flat = wait(index)
        return [flat[part] for part in parts]

    def make(extra):
        count = 1 if sizes is None else len(sizes)
        pieces = numpy_outputs(result, list(tokens) + extra, [tf.as_dtype(payload_dtype)] * count,
                               f"tp_collect_{group.name}_{index}")
        for piece, size in zip(pieces, sizes or [None]):
            piece.set_shape([size])
        return pieces
    return sequencer.run_in_order(make)


def numpy_outputs(function: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
                  dtypes: Sequence[tf.DType], name: str) -> list[tf.Tensor]:
    """A stateful ``tf.numpy_function`` op of ``len(dtypes)`` outputs, as a list also eagerly
    (where a one-element ``Tout`` list would give a bare tensor)."""
    outputs = tf.numpy_function(function, list(inputs), list(dtypes), stateful=True, name=name)
    return [outputs] if isinstance(outputs, tf.Tensor) else list(outputs)


def bucketed_collective(engine: engine_lib.CommEngine, name: str,
                        values: Sequence[tf.Tensor], plan: Sequence[buckets_lib.Bucket],
                        collective: Collective, sequencer: Sequencer,
                        names: Sequence[str] | None = None,
                        wait_for: Sequence[tf.Tensor] = ()) -> list[tf.Tensor]:
    """Runs ``collective`` on every bucket of ``plan`` through the engine.

    Args:
      engine: the process's engine.
      name: names the group in stats, timelines and errors.
      values: tensors with static shapes; ``plan`` assigns each to one bucket.
      plan: from :func:`buckets.plan_buckets`.
      collective: run on the engine thread per bucket; its result has the payload's shape
        and dtype (e.g. an in-place MPI all-reduce).
      sequencer: the strategy's; orders these ops with its other communication ops.
      names: one per value, for per-layer statistics (default: positions).
      wait_for: tensors every enqueue must wait for (``overlap=False`` passes all gradients
        here, so nothing is sent before the backward pass ends).

    Returns:
      One tensor per value, same shape and dtype, holding that value's part of the results.
      Works eagerly (blocks until done) and in graphs (the collect ops block when run).
    """
    names = list(names) if names is not None else [str(i) for i in range(len(values))]
    group = engine_lib.CollectiveGroup(name, collective, bucket_layers(plan, names))
    with tf.control_dependencies(list(wait_for)):
        tokens = [enqueue(engine, group, b.index, [values[i] for i in b.members], sequencer,
                           concatenated(b.payload_dtype)) for b in plan]
    results: list[tf.Tensor | None] = [None] * len(values)
    for bucket in plan:
        pieces = collect(group, bucket.index, tokens, bucket.payload_dtype, bucket.sizes,
                          sequencer)
        for position, piece in zip(bucket.members, pieces):
            value = values[position]
            results[position] = tf.reshape(tf.cast(piece, value.dtype), value.shape)
    return results


def bucket_layers(plan: Sequence[buckets_lib.Bucket],
                  names: Sequence[str]) -> list[list[tuple[str, int]]]:
    """Per bucket, its members' names and payload bytes (a CollectiveGroup's statistics)."""
    return [[(names[i], n * b.payload_dtype.itemsize) for i, n in zip(b.members, b.sizes)]
            for b in plan]


def gather_rows(engine: engine_lib.CommEngine, name: str, value: tf.Tensor,
                collective: Collective, sequencer: Sequencer) -> tf.Tensor:
    """Concatenates every rank's ``value`` along axis 0, in rank order.

    ``value`` may have a different leading dimension on each rank; its other dimensions must
    be static and equal on every rank. Eager or graph, like :func:`bucketed_collective`.
    """
    inner = value.shape[1:]
    if not inner.is_fully_defined():
        raise ValueError(f"tf_poseidon gather needs static dimensions after axis 0, got {value.shape}.")
    dtype = np.dtype(value.dtype.as_numpy_dtype)
    group = engine_lib.CollectiveGroup(name, collective, [[(name, 0)]])
    token = enqueue(engine, group, 0, [value], sequencer, concatenated(dtype))
    [flat] = collect(group, 0, [token], dtype, None, sequencer)
    return tf.reshape(flat, [-1] + inner.as_list())
