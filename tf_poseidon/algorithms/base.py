"""The algorithm contract: a declarative :class:`Algorithm` and its runtime :class:`AlgorithmImpl`.

Bagua's split. The user constructs an Algorithm with its own knobs
(``tp.algorithms.SSP(staleness=2)``); it validates them, declares what it is (``lockstep``,
``asynchronous``, ``plans``) and which collective groups its training posts
(``training_groups``), and ``reify(context)`` makes the runtime object once per strategy, when
the first replica function runs with more than one rank. The strategy then calls the
AlgorithmImpl from the Keras optimizer integration (keras_integration.py), in a replica
context, while the train step is traced:

1. ``reduce_gradients(grads, variables, local_batch)`` — before the optimizer's update: returns
   the gradients the optimizer applies (sync: Σ_p g_p; algorithms that communicate parameters
   instead return the local gradient, see ``local_mean``).
2. ``after_update(variables)`` — after the optimizer has updated ``variables`` (in the same
   step): creates the ops of the algorithm's follow-up (stateful ops in a tf.function always
   run). SSP exchanges parameter deltas here, EASGD makes its elastic move.
3. ``consistent_state()`` — a context manager entered on every rank around saving, exporting,
   evaluating and predicting: within it every rank's variables hold the state to use, equal on
   every rank. ``drain()`` is the same without the context (SSP: apply everything pending).
4. ``tracing_replica_function()`` — a context manager the strategy enters while it runs (and so
   traces) the replica function; an algorithm that needs to see the forward pass (SFB captures
   Dense layers' inputs) hooks in here.
5. ``plan()`` — the per-layer protocol plan of the last traced step (sacp/plan.py), or None
   for an algorithm that does not plan; ``stats()`` — its own figures for ``strategy.stats()``.
6. ``training_state()`` / ``restore_training_state(arrays)`` — state of the algorithm's own
   that the next steps depend on and that is not in the model's or the optimizer's variables
   (sync's low-rank residuals): ``tp.callbacks.BackupAndRestore`` saves and restores it.

Graph ops an implementation creates go through ``graph_ops.run_buckets`` (or the Sequencer), so
they reach the engine in the same order on every rank; ``AlgorithmImpl.sum_over_ranks`` is the
common case, a sum over ranks of a list of tensors. A new algorithm is one module: an
Algorithm subclass registered with ``tf_poseidon.algorithms.register`` and its AlgorithmImpl.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ClassVar, Sequence

import tensorflow as tf

from tf_poseidon.comm import buckets as buckets_lib, graph_ops
from tf_poseidon.comm.codecs import Codec
from tf_poseidon.comm.engine import CollectiveGroup
from tf_poseidon.comm.protocol import AllReduce, BucketProtocol


@dataclasses.dataclass(frozen=True)
class AlgorithmContext:
    """What an implementation is built with (``Algorithm.reify``): the process's engine and
    Sequencer, the number of ranks, and the strategy's options (config.StrategyConfig: the
    codec, SFB choice, bucket cap, overlap, bandwidth)."""

    engine: Any
    sequencer: Any
    num_replicas: int
    config: Any


class Algorithm:
    """Declarative base: the knobs a user passes, checked in ``__init__``, and capabilities.

    ``name``: the ``mode=`` name it is registered under. ``lockstep``: whether every rank
    finishes every step together — then per-step logs can be global for free; an algorithm
    whose ranks run ahead of each other must not add a per-step collective, so its progress bar
    shows rank 0's local metrics during an epoch (epoch logs and ``History`` stay global).
    ``asynchronous``: whether no rank ever waits for another during training (then even the
    loss-scale finite check is decided locally). ``plans``: whether its implementation sums
    gradients through the per-layer protocol plan (sacp/: all-reduce, SFB, sparse rows,
    low-rank per gradient), so that ``lowrank=`` applies to it and ``AlgorithmImpl.plan``
    returns that plan once a step is traced; an algorithm that does not plan moves what it
    moves itself, and ``strategy.plan()`` says so. ``training_groups``: the names of the
    collective groups (and engine calls) its training steps post; when ranks post different
    collectives and one posted one of these, the error says that the ranks ran different
    numbers of steps (comm/agreement.py).
    """

    name: ClassVar[str] = ""
    lockstep: bool = True
    asynchronous: bool = False
    plans: bool = False
    training_groups: ClassVar[tuple[str, ...]] = ()

    def validate(self, num_replicas: int) -> None:
        """Raises ValueError if the knobs cannot work on ``num_replicas`` ranks (called when
        the strategy is built, with the world's size)."""

    def reify(self, context: AlgorithmContext) -> "AlgorithmImpl":
        """The runtime object; called once per strategy, on every rank alike."""
        raise NotImplementedError

    def options(self) -> dict:
        """The knobs as given (for ``repr``, equality and logs)."""
        return {}

    def __repr__(self) -> str:
        knobs = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({knobs})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.options() == self.options()

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.options().items()))))


class AlgorithmImpl:
    """Runtime base: the no-op parts of the contract (module docstring) and shared helpers."""

    def __init__(self, context: AlgorithmContext):
        self.engine = context.engine
        self.sequencer = context.sequencer
        self.config = context.config
        self.num_replicas = context.num_replicas
        self.codec: Codec = context.config.codec
        self.bucket_bytes = context.config.bucket_bytes or buckets_lib.DEFAULT_BUCKET_BYTES
        self.first_bucket_bytes = min(self.bucket_bytes, buckets_lib.DEFAULT_FIRST_BUCKET_BYTES)
        # How the algorithm's exchanges are summed over ranks: through the strategy's codec.
        self.summing = AllReduce(self.codec)

    def reduce_gradients(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable],
                         local_batch: tf.Tensor | None) -> list[tf.Tensor]:
        raise NotImplementedError

    def after_update(self, variables: Sequence[tf.Variable]) -> None:
        pass

    def drain(self) -> None:
        """Every rank: apply every pending update (blocking, collective)."""

    def consistent_state(self):
        self.drain()
        return contextlib.nullcontext()

    def tracing_replica_function(self):
        return contextlib.nullcontext()

    def plan(self):
        """The per-layer plan of the last traced train step (sacp.plan.Plan); None before one
        is traced, and always for an algorithm that does not declare ``plans``."""
        return None

    def stats(self) -> dict:
        """Algorithm-specific statistics for ``strategy.stats()["mode"]`` (JSON-serialisable)."""
        return {}

    def training_state(self) -> dict[str, Any]:
        """Every rank, blocking (may be collective): named numpy arrays of the state a backup
        must hold; rank 0's are the ones written. Default: none."""
        return {}

    def restore_training_state(self, arrays: dict[str, Any]) -> None:
        """Every rank, not collective: takes what ``training_state`` returned (read back from
        a backup, possibly made on another number of ranks)."""

    def plan_buckets(self, entries: Sequence[Any],
                     backprop_order: bool = True) -> list[buckets_lib.Bucket]:
        """``entries`` (Items or tensors) in buckets of the strategy's ``bucket_bytes``."""
        return buckets_lib.plan_buckets(entries, self.bucket_bytes, self.first_bucket_bytes,
                                        backprop_order)

    def sum_over_ranks(self, name: str, tensors: Sequence[tf.Tensor],
                       names: Sequence[str] | None = None,
                       protocol: BucketProtocol | None = None) -> list[tf.Tensor]:
        """Every rank, with the same ``name`` and shapes in the same order (a collective):
        each of ``tensors`` (static shapes) summed over the ranks, a tensor of its shape and
        dtype. The tensors go in buckets of the strategy's ``bucket_bytes``, in the order
        given, as one collective group ``name`` carried by ``protocol`` (default
        ``self.summing``: through the strategy's codec) and run by ``graph_ops.run_buckets``,
        so the Sequencer orders it with the process's other communication ops. ``names``
        label the tensors in the statistics (default: their positions). Eagerly it blocks
        until done; in a graph the collect ops block when run, at most the collective
        timeout."""
        protocol = protocol or self.summing
        names = names if names is not None else [str(i) for i in range(len(tensors))]
        group = CollectiveGroup(name, self.plan_buckets(items_of(tensors, names, protocol.kind),
                                                        False), {protocol.kind: protocol})
        return graph_ops.run_buckets(self.engine, self.sequencer, group, [[t] for t in tensors])

    def local_mean(self, grads: Sequence[tf.Tensor],
                   local_batch: tf.Tensor | None = None) -> list[tf.Tensor]:
        """The gradient of the mean loss over this rank's batch: Keras scales every rank's loss
        by 1/P for a sum over ranks, which algorithms that apply local gradients undo. With
        ``local_batch`` (this rank's example count), a rank without examples gets zeros, even
        where its loss over no examples made NaN (one pass per gradient either way)."""
        factor = tf.constant(float(self.num_replicas))
        if local_batch is not None:
            factor = tf.where(local_batch > 0, factor, 0.0)

        def scaled(g):
            return tf.math.multiply_no_nan(g, tf.cast(factor, g.dtype))
        return [tf.IndexedSlices(scaled(g.values), g.indices, g.dense_shape)
                if isinstance(g, tf.IndexedSlices) else scaled(g) for g in grads]


def variable_names(variables: Sequence[tf.Variable]) -> list[str]:
    """Names for statistics: the Keras path of each variable (``dense/kernel``)."""
    return [v.name.split(":")[0] for v in variables]


def items_of(values: Sequence[tf.Tensor], names: Sequence[str],
             kind: str = buckets_lib.ALLREDUCE) -> list[buckets_lib.Item]:
    """One bucket Item per value (static shapes), named for the statistics."""
    return [buckets_lib.Item.of(v, name, kind) for v, name in zip(values, names)]
