"""The graph side of the engine: ops that hand buckets to it and bring results back.

:func:`run_buckets` is the one choreography every reduction and gather goes through. Per
bucket, the protocol's graph side (``graph_side``: the host or the device form of an all-reduce
bucket, comm/datapath.py) first makes the enqueue op's inputs (its ``stage``: the members'
tensors, or one buffer packed on their device), then two ops:

* ``enqueue``: a non-blocking op. It runs as soon as its inputs exist (and the previous
  bucket was handed over), packs them into one payload (the protocol's ``pack``), hands it to
  the engine and returns a scalar int64 *token*.
* ``collect``: takes *all* tokens of the group as inputs and blocks until the bucket's result
  is there (the protocol's ``receive``). Because it depends on every token, no inter-op thread
  blocks before the whole group has been handed over — otherwise, with only as many inter-op
  threads as cores, a rank could wait on itself. Its outputs are the result's pieces (outputs
  of the op itself: no split copies them again).

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

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon.comm import engine as engine_lib
from tf_poseidon.comm.buckets import Bucket
from tf_poseidon.comm.protocol import BucketProtocol


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

    def run_in_order(self, make_op) -> Any:
        """``make_op(extra_inputs)`` builds the op; in a graph, ``extra_inputs`` is the counter
        read it must consume (as an ignored input), eagerly it is empty (ops run when built)."""
        if tf.executing_eagerly():
            return make_op([])
        turn = self._counter.read_value()
        op = make_op([turn])
        with tf.control_dependencies(tf.nest.flatten(op)):
            self._counter.assign_add(1)
        return op


def numpy_outputs(function: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
                  dtypes: Sequence[tf.DType], name: str) -> list[tf.Tensor]:
    """A stateful ``tf.numpy_function`` op of ``len(dtypes)`` outputs, as a list also eagerly
    (where a one-element ``Tout`` list would give a bare tensor)."""
    outputs = tf.numpy_function(function, list(inputs), list(dtypes), stateful=True, name=name)
    return [outputs] if isinstance(outputs, tf.Tensor) else list(outputs)


def enqueue(engine: engine_lib.CommEngine, group: engine_lib.CollectiveGroup, bucket: Bucket,
            tensors: Sequence[tf.Tensor], sequencer: Sequencer,
            pack: Callable[[Bucket, Sequence[np.ndarray]], np.ndarray]) -> tf.Tensor:
    """The op that hands ``pack(bucket, values of tensors)`` to the engine as ``bucket``'s
    payload. ``pack`` runs on a TensorFlow thread and must not return memory of its inputs.
    Returns the op's token."""
    def hand_over(*arrays: np.ndarray) -> np.int64:
        engine.submit(group, bucket.index, pack(bucket, arrays[:len(tensors)]))
        return np.int64(bucket.index)

    def make(extra):
        token = tf.numpy_function(hand_over, list(tensors) + extra, tf.int64, stateful=True,
                                  name=f"tp_enqueue_{group.name}_{bucket.index}")
        token.set_shape([])
        return token
    return sequencer.run_in_order(make)


def collect(group: engine_lib.CollectiveGroup, bucket: Bucket, tokens: Sequence[tf.Tensor],
            protocol: BucketProtocol, sequencer: Sequencer) -> list[tf.Tensor]:
    """The op that, once every token exists, returns ``protocol.receive(group, bucket)`` as
    tensors of ``protocol.outputs(bucket)``."""
    specs = protocol.outputs(bucket)

    def make(extra):
        pieces = numpy_outputs(lambda *_: protocol.receive(group, bucket), list(tokens) + extra,
                               [dtype for dtype, _ in specs],
                               f"tp_collect_{group.name}_{bucket.index}")
        for piece, (_, shape) in zip(pieces, specs):
            piece.set_shape(shape)
        return pieces
    return sequencer.run_in_order(make)


def run_buckets(engine: engine_lib.CommEngine, sequencer: Sequencer,
                group: engine_lib.CollectiveGroup, inputs: Sequence[Sequence[tf.Tensor]],
                wait_for: Sequence[tf.Tensor] = ()) -> list[Any]:
    """Runs every bucket of ``group`` through the engine, each by the protocol of its kind.

    Args:
      engine, sequencer: the strategy's; the sequencer orders these ops with the process's
        other communication ops.
      group: the buckets (``group.buckets``, from :func:`buckets.plan_buckets`: member
        positions index ``inputs``) and the protocol of each kind. A group made once and run
        on every trace keeps counting its instances across retraces (SSP's exchange does).
      inputs: per member, the tensors its protocol packs (an all-reduce member: one tensor
        with a static shape), on the device they were computed on.
      wait_for: tensors every enqueue must wait for (``overlap=False`` passes all gradients
        here, so nothing is sent before the backward pass ends).

    Returns:
      Per member, what its protocol's ``finish`` made of the result (an all-reduce member: a
      tensor of its shape and dtype). Works eagerly (blocks until done) and in graphs (the
      collect ops block when run, at most the collective timeout).
    """
    sides, tokens = [], []
    with tf.control_dependencies(list(wait_for)):
        for bucket in group.buckets:
            tensors = [t for i in bucket.members for t in inputs[i]]
            side = group.protocols[bucket.kind].graph_side(bucket, tensors)
            sides.append(side)
            tokens.append(enqueue(engine, group, bucket, side.stage(bucket, tensors),
                                  sequencer, side.pack))
    results: list[Any] = [None] * len(inputs)
    for bucket, side in zip(group.buckets, sides):
        outputs = collect(group, bucket, tokens, side, sequencer)
        finished = side.finish(bucket, outputs, [inputs[i] for i in bucket.members])
        for position, result in zip(bucket.members, finished):
            results[position] = result
    return results
