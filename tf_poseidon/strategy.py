"""PoseidonStrategy: a tf.distribute.Strategy with one replica per process, over MPI.

Contract in brief (details on each method):

* One replica per process; ``num_replicas_in_sync`` is the number of processes P, and the
  replica id in a replica context is the process's rank.
* Variables are created locally on every rank; before the first step, rank 0's values are
  broadcast (initial_sync.py).
* ``experimental_distribute_dataset`` takes a dataset of *global* batches and gives each rank
  its slice (data.py); ``distribute_datasets_from_function`` calls the function once per
  process with an InputContext naming this rank.
* ``run`` calls the function in a replica context on this process's device and returns this
  replica's results (plain tensors, not PerReplica: there is one local replica).
* Gradients the Keras optimizer applies go through the strategy's algorithm (algorithms/);
  other replica-context all-reduces and cross-replica ``reduce``/``gather`` are exact
  collectives over all ranks. All of them run through the process's communication engine
  (comm/).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Sequence

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import one_device_strategy
from tensorflow.python.distribute import reduce_util

from tf_poseidon import batch_draws, batchnorm
from tf_poseidon import data as data_lib
from tf_poseidon import initial_sync
from tf_poseidon import keras_integration
from tf_poseidon import world as world_lib
from tf_poseidon.algorithms import Algorithm, AlgorithmContext, AlgorithmImpl
from tf_poseidon.comm import buckets as buckets_lib
from tf_poseidon.comm import codecs, collectives, graph_ops
from tf_poseidon.comm import stats as stats_lib
from tf_poseidon.comm.codecs import Codec
from tf_poseidon.comm.engine import CollectiveGroup, get_engine
from tf_poseidon.comm.gather import gather_along
from tf_poseidon.comm.protocol import AllReduce
from tf_poseidon.config import StrategyConfig

_EXACT_SUM = AllReduce(codecs.get("none"))


class PoseidonStrategy(distribute_lib.Strategy):
    """Data-parallel training across processes launched by MPI (or a single process).

    ```python
    strategy = tp.PoseidonStrategy()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=5)
    ```

    Args:
      algorithm: how the ranks' work becomes the update every rank applies: a
        ``tp.algorithms`` object (``Sync()``, ``SSP(staleness=2)``, ``EASGD(tau=4)``, or a
        registered algorithm of your own); default ``Sync()``. Or the keyword form: ``mode``
        ("sync", "ssp", "easgd" or another registered name) with that algorithm's options
        (``staleness=``; ``tau=``, ``alpha=``, ``easgd_async=``) as further keywords.
      compression: wire format of gradients: "none" (float32), "fp16", "bf16", another
        registered codec name, or a ``tp.codecs.Codec`` instance (docs/compression.md).
      sfb: sufficient factor broadcasting for Dense layers: "auto" (cost model decides per
        layer), "always" (every eligible layer), "never". Used by the algorithms that reduce
        gradients (sync).
      bucket_bytes: cap on a gradient bucket's size in bytes; None picks the default.
      overlap: communicate each bucket as soon as its gradients exist (wait-free backprop);
        False sends everything after the backward pass (the naive baseline).
      timeline: path of a Chrome-trace JSON file (Perfetto, chrome://tracing) that rank 0
        writes at exit with every rank's per-bucket communication events; the same as setting
        ``TF_POSEIDON_TIMELINE`` (or ``tfposeidon-run --timeline-filename``).
      bandwidth_gbps: the network bandwidth per rank in Gbit/s that the per-layer cost model
        assumes (SFB, low-rank); None (default) measures it with a short probe when a train step is first
        traced (see :meth:`plan`).
      sync_batchnorm: BatchNormalization layers normalize with the statistics of the global
        batch (exact: P ranks train like one process; two small collectives per BN layer and
        step), as ``BatchNormalization(synchronized=True)`` does for one layer. False (default):
        each rank's own batch statistics, with the moving statistics combined across ranks
        after every step (tf_poseidon/batchnorm.py).
      lowrank: ``tp.PowerSGD(rank=4, start_step=10, min_compression=2.0, choice="auto")``
        to sum matrix-shaped gradients (Dense kernels, convolution kernels as
        [kh·kw·c_in, c_out]) as rank-r approximations with error feedback: two all-reduces of
        (m+n)·r values instead of one of m·n (a dict of PowerSGD's arguments also works).
        Which gradients go low-rank is the per-layer plan's choice, next to all-reduce and
        SFB (:meth:`plan`); vectors and matrices that compress less than ``min_compression``
        are all-reduced. ``compression`` stays the wire format of everything, P and Q too.
        Approximate: P ranks no longer train exactly like one process. The residuals and Q
        are training state (saved and restored by ``tp.callbacks.BackupAndRestore``). None
        (default): off. Sync only (docs/compression.md).
      autotune: during the first steps of training, try overlap on and off and, with
        ``compression="fp16"``, fp16 or the exact sum per bucket, and keep the setting with
        the shortest measured step (agreed by every rank; about 20 steps of trials). What was
        tried and chosen: ``stats()["mode"]["autotune"]``. Sync only. True (default): it never
        measured slower than the fixed settings (docs/benchmarks.md); False: the setting as
        given (tf_poseidon/comm/autotune.py).

    Raises:
      ValueError: an argument has an invalid value (the message names it and what is allowed).
      tf_poseidon.world.WorldError: the launcher's environment describes no usable world.
    """

    def __init__(self, algorithm: Algorithm | str | None = None, *, mode: str | None = None,
                 compression: str | Codec = "none", sfb: str = "auto",
                 bucket_bytes: int | None = None, overlap: bool = True,
                 timeline: str | None = None, bandwidth_gbps: float | None = None,
                 sync_batchnorm: bool = False, lowrank=None, autotune: bool = True,
                 **algorithm_options):
        config = StrategyConfig(algorithm, mode=mode, compression=compression, sfb=sfb,
                                bucket_bytes=bucket_bytes, overlap=overlap, timeline=timeline,
                                bandwidth_gbps=bandwidth_gbps, sync_batchnorm=sync_batchnorm,
                                lowrank=lowrank, autotune=autotune, **algorithm_options)
        if timeline:
            os.environ["TF_POSEIDON_TIMELINE"] = timeline
        super().__init__(PoseidonExtended(self, config))
        distribute_lib.distribution_strategy_gauge.get_cell("V2").set("PoseidonStrategy")
        _log_on_chief_only()

    @property
    def config(self) -> StrategyConfig:
        """The validated options this strategy was built with."""
        return self.extended.config

    def drain(self) -> None:
        """Applies every pending update on every rank (SSP); then all replicas agree.

        Call on every rank, outside a replica function (blocking, collective). Keras ``fit``
        drains at its end; saving and exporting drain through ``consistent_state``. A no-op in
        sync mode, where nothing is ever pending.
        """
        self.extended.drain()

    def plan(self):
        """The per-layer plan: which protocol carries each gradient that has a choice (Dense
        kernels: all-reduce or SFB; embeddings: sparse rows; with ``lowrank``, every matrix:
        low-rank too), and why.

        Any rank, any time, non-blocking; prints the table on rank 0 and returns a
        ``tf_poseidon.sacp.Plan`` (``rows``: layer, matrix shape, local batch K, each
        protocol's predicted bytes and time (``estimates``), choice and reason;
        ``as_dict()``). The plan is made, and agreed by every rank, when the train step is
        first traced; before that the returned plan has no rows and its note says so. See
        docs/sfb.md and docs/compression.md.
        """
        from tf_poseidon import sacp
        return sacp.plan_of(self)

    def stats(self, last_steps: int = 20) -> dict:
        """This rank's communication statistics for its last ``last_steps`` training steps.

        Any rank, any time, non-blocking. A dict (JSON-serialisable): ``steps`` (per step: step
        time, communication time, the part of it overlapped with the backward pass, bytes sent
        and received, and per bucket the same with its layers), ``per_layer`` (bytes per
        variable per step), ``summary`` (means, and ``hidden_fraction`` = overlapped /
        communication time), ``mode`` (the mode's own figures; SSP: ``staleness_histogram``,
        how many steps late remote updates were applied, ``blocked_on_bound_s`` and
        ``batch_steps``).
        Definitions in tf_poseidon/comm/stats.py. In a world of one process there is no
        communication: the lists are empty. SSP's delta exchange shows as group
        "ssp_deltas", not "gradients", in ``steps``.
        """
        if not self.extended._distributed:
            return stats_lib.step_report([], last_steps)
        report = stats_lib.step_report(self.extended.engine.stats.records(), last_steps)
        report["mode"] = self.extended.algorithm_impl.stats()
        return report

    def __deepcopy__(self, memo):
        # Keras and tf.function may deep-copy objects holding the strategy; it is a singleton
        # per process resource (the engine), so a copy is the same object.
        memo[id(self)] = self
        return self


def _log_on_chief_only() -> None:
    """Keras progress bars and logs print on rank 0 only, unless TF_POSEIDON_LOG_ALL_RANKS=1."""
    if not world_lib.is_chief() and os.environ.get("TF_POSEIDON_LOG_ALL_RANKS") != "1":
        import keras
        keras.config.disable_interactive_logging()


class _ReplicaScope(threading.local):
    """How deep this thread is in ``run``'s replica functions (variables created inside one
    are not broadcast from rank 0: they start equal by construction) and in
    :meth:`PoseidonExtended.rank_local_variables` (variables created inside hold this rank's
    own values)."""

    depth: int = 0
    rank_local: int = 0


class PoseidonExtended(one_device_strategy.OneDeviceExtended):
    """The implementation behind :class:`PoseidonStrategy` (``strategy.extended``)."""

    def __init__(self, container_strategy: PoseidonStrategy, config: StrategyConfig):
        device = "/device:GPU:0" if tf.config.list_logical_devices("GPU") else "/device:CPU:0"
        super().__init__(container_strategy, device)
        self.config = config
        self._world = world_lib.world()
        self._variables: list[tf.Variable] = []
        self._num_synced = 0
        self._replica_scope = _ReplicaScope()
        self._algorithm_impl: AlgorithmImpl | None = None
        self._state_to_combine: dict = {}  # ref -> variable, for algorithms not in lockstep
        self.sequencer = graph_ops.Sequencer() if self._world.size > 1 else None

    # -- world --------------------------------------------------------------------------

    @property
    def _num_replicas_in_sync(self) -> int:
        return self._world.size

    def _use_merge_call(self) -> bool:
        return False

    @property
    def _distributed(self) -> bool:
        return self._world.size > 1

    @property
    def engine(self):
        """The process's communication engine (started on first use; only when P > 1)."""
        return get_engine()

    @property
    def algorithm_impl(self) -> AlgorithmImpl:
        """The algorithm's runtime object (``config.algorithm.reify``), built on first use (on
        every rank at the same point: it may be collective). Only when P > 1."""
        if self._algorithm_impl is None:
            algorithm = self.config.algorithm
            self.engine.declare_training_groups(algorithm.training_groups)
            self._algorithm_impl = algorithm.reify(AlgorithmContext(
                self.engine, self.sequencer, self._world.size, self.config))
        return self._algorithm_impl

    @property
    def algorithm_impl_if_built(self) -> AlgorithmImpl | None:
        """The runtime object if it exists already (never starts MPI)."""
        return self._algorithm_impl

    @property
    def should_checkpoint(self) -> bool:
        """Only the chief (rank 0) writes checkpoints."""
        return self._world.is_chief

    @property
    def should_save_summary(self) -> bool:
        return self._world.is_chief

    def consistent_state(self):
        """A context manager; within it, every rank's model variables hold the state to save,
        export, evaluate or predict with, equal on every rank.

        Call it on every rank (it may be collective). Sync mode: they always do. SSP applies
        the pending updates (a drain); EASGD swaps the center variables in and restores the
        local ones on exit; algorithms not in lockstep combine the non-trainable state first.
        Checkpoint and export code (callbacks.py, export.py) uses it.
        """
        if not self._distributed:
            return contextlib.nullcontext()
        batchnorm.combine_state(self, list(self._state_to_combine.values()), None)
        return self.algorithm_impl.consistent_state()

    # -- variables ----------------------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        # Variables created inside a replica function (optimizer slots a custom loop creates
        # in its first step, the layers of a model first called there) start equal on every
        # rank by construction, their initializers drawing alike on every rank (not by rows);
        # only those created outside are broadcast from rank 0.
        initial = kwargs.get("initial_value")
        context = tf.distribute.get_replica_context()
        if getattr(context, "draw_window", None) is not None and callable(initial):
            def drawn_alike():
                with context.drawing_by_rows(None):
                    return initial()
            kwargs["initial_value"] = drawn_alike
        variable = super()._create_variable(next_creator, **kwargs)
        if not (self._replica_scope.depth or self._replica_scope.rank_local):
            self._variables.append(variable)
        return variable

    @contextlib.contextmanager
    def rank_local_variables(self):
        """Variables created inside, on this thread, hold this rank's own values (a stateful
        RNN's states of this rank's rows: keras_integration): they are neither checked against
        the other ranks' variables nor broadcast from rank 0, and may differ in shape."""
        self._replica_scope.rank_local += 1
        try:
            yield
        finally:
            self._replica_scope.rank_local -= 1

    def _sync_new_variables(self) -> None:
        """Collective: checks and broadcasts the variables created since the last call."""
        if not self._distributed or self._num_synced == len(self._variables):
            return
        new = self._variables[self._num_synced:]
        with tf.init_scope():
            initial_sync.check_and_broadcast(self.engine, new)
        self._num_synced = len(self._variables)

    # -- replicas -----------------------------------------------------------------------

    def _call_for_each_replica(self, fn: Callable, args: Sequence, kwargs: dict | None):
        """Runs ``fn(*args, **kwargs)`` as this process's replica; returns its local results.

        Before the first replica function (and whenever variables were created since), the
        ranks' variables are checked and rank 0's values broadcast: a blocking collective.
        Where the arguments hold a batch (the first tensor of rank ≥ 1 gives its rows), Keras'
        random draws take the rows of a window assumed from this rank's rows
        (batch_draws.assumed_window: no communication, as ``run`` may run on some ranks only);
        Keras' train and test functions set the ranks' agreed window within it.
        """
        self._sync_new_variables()
        strategy = self._container_strategy()
        scope = self._replica_scope
        scope.depth += 1
        tracing = (self.algorithm_impl.tracing_replica_function() if self._distributed
                   else contextlib.nullcontext())
        try:
            with tf.device(self._device):
                context = _PoseidonReplicaContext(strategy, self._world.rank)
                rows = data_lib.batch_size_of((args, kwargs)) if self._distributed else None
                with context, tracing, context.drawing_by_rows(None if rows is None else (
                        batch_draws.assumed_window(rows, self._world.rank, self._world.size,
                                                   xla=False))):
                    return fn(*args, **(kwargs or {}))
        finally:
            scope.depth -= 1

    def in_replica_function(self) -> bool:
        """Whether this thread is inside ``run``'s replica function (tracing or eager)."""
        return self._replica_scope.depth > 0

    def reduce_gradients(self, grads: Sequence[tf.Tensor],
                         variables: Sequence[tf.Variable]) -> list[tf.Tensor]:
        """Replica context: the gradients every rank applies, per the strategy's algorithm.

        Called by the Keras optimizer integration with the local gradients of ``variables``
        (dense with static shapes, or ``IndexedSlices`` of embeddings, which may come back as
        IndexedSlices: see algorithms/sync.py). Sync: Σ_p g_p, weighted by batch share when
        the replica context carries this replica's example count
        (``_PoseidonReplicaContext.local_batch``, set by Keras' train step integration).
        """
        grads = [g if isinstance(g, tf.IndexedSlices) else tf.convert_to_tensor(g)
                 for g in grads]
        if not self._distributed:
            return grads
        context = tf.distribute.get_replica_context()
        local_batch = getattr(context, "local_batch", None)
        return self.algorithm_impl.reduce_gradients(grads, variables, local_batch)

    def after_update(self, variables: Sequence[tf.Variable]) -> None:
        """Replica context, right after the optimizer updated ``variables``: the mode's
        follow-up (SSP's delta exchange, EASGD's elastic move; nothing in sync mode)."""
        if self._distributed:
            self.algorithm_impl.after_update(variables)

    def drain(self) -> None:
        """Every rank, eagerly: applies every pending update (SSP) and combines the models'
        non-trainable state (algorithms not in lockstep), so replicas agree."""
        if self._distributed:
            self.algorithm_impl.drain()
            batchnorm.combine_state(self, list(self._state_to_combine.values()), None)

    def synchronize_state(self, model, local_batch: tf.Tensor | None) -> None:
        """Replica context, at the end of every training step of ``fit`` (the train function
        keras_integration builds, for Keras' ``train_step`` and a model's own alike):
        the model's non-trainable float variables (BatchNormalization's moving statistics)
        become equal on every rank, weighted by row count (batchnorm.combine_state: one small
        collective). Algorithms whose ranks do not step together combine them when they drain
        instead (at the end of ``fit``, before evaluating, predicting and saving)."""
        if not self._distributed:
            return
        variables = batchnorm.state_variables(model, self.config.sync_batchnorm)
        if self.config.algorithm.lockstep:
            batchnorm.combine_state(self, variables, local_batch)
        else:
            self._state_to_combine.update((v.ref(), v) for v in variables)

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        """Replica context: exact SUM or MEAN of ``value`` (a flat list) over all ranks."""
        del options
        if not self._distributed:
            return list(value)  # IndexedSlices stay sparse, as without a strategy
        flat = [tf.convert_to_tensor(v) for v in value]
        return self._all_reduce_exact(reduce_op, flat, name="all_reduce")

    def sum_over_ranks(self, values: Sequence[tf.Tensor], name: str) -> list[tf.Tensor]:
        """The exact, unweighted sum over ranks of each tensor of ``values`` (static shapes).

        Any context, every rank must call it alike (a collective); ``name`` labels it in
        stats and timelines. Used for metric states and the loss-scale finite check.
        """
        return self._all_reduce_exact(reduce_util.ReduceOp.SUM,
                                      [tf.convert_to_tensor(v) for v in values], name=name)

    def _all_reduce_exact(self, reduce_op: reduce_util.ReduceOp, flat: list[tf.Tensor],
                          name: str) -> list[tf.Tensor]:
        if not self._distributed or not flat:
            return list(flat)
        plan = buckets_lib.plan_buckets(flat, backprop_order=False,
                                        first_bucket_bytes=buckets_lib.DEFAULT_BUCKET_BYTES)
        group = CollectiveGroup(name, plan, {_EXACT_SUM.kind: _EXACT_SUM})
        summed = graph_ops.run_buckets(self.engine, self.sequencer, group, [[v] for v in flat])
        if reduce_op == reduce_util.ReduceOp.MEAN:
            summed = [s / tf.cast(self._world.size, s.dtype) for s in summed]
        return summed

    # -- cross-replica ------------------------------------------------------------------

    def _reduce_to(self, reduce_op, value, destinations, options):
        """Cross-replica: SUM or MEAN of this rank's ``value`` over all ranks (every rank gets it)."""
        del destinations, options
        if isinstance(value, (int, float)):
            value = tf.constant(value)
        tensor = tf.convert_to_tensor(value)
        return self._all_reduce_exact(reduce_op, [tensor], name="reduce")[0]

    def _gather_to_implementation(self, value, destinations, axis, options):
        """Cross-replica: every rank's ``value`` concatenated along ``axis`` in rank order."""
        del destinations, options
        return self.gather_along(tf.convert_to_tensor(value), axis)

    def gather_along(self, tensor: tf.Tensor, axis: int) -> tf.Tensor:
        """Any context, every rank alike (a collective): every rank's ``tensor`` concatenated
        along ``axis`` in rank order (``tensor`` itself in a world of one)."""
        if not self._distributed:
            return tensor
        return gather_along(self.engine, self.sequencer, tensor, axis)

    # -- input --------------------------------------------------------------------------

    def _experimental_distribute_dataset(self, dataset, options):
        """This rank's slices of ``dataset``'s global batches (:meth:`slices_of_global_batches`),
        once the ranks have checked their input (:meth:`check_input`: collective and blocking
        where there are several ranks, as every rank's call of this method is; ValueError on
        every rank where it is refused)."""
        del options
        if self._distributed:
            self.check_input(data_lib.describe_dataset(dataset), data_lib.cache_files(dataset))
        return self.slices_of_global_batches(dataset)

    def slices_of_global_batches(self, dataset: tf.data.Dataset) -> data_lib.RankLocalDataset:
        """This rank's slices of ``dataset``'s global batches (data.py), without a check: for
        Keras' ``fit``, ``evaluate`` and ``predict``, whose input is checked with what Keras'
        data adapter knows of it (keras_integration)."""
        return data_lib.RankLocalDataset(data_lib.distribute_global_batches(
            dataset, self._world.rank, self._world.size))

    def check_input(self, description: dict, cache_files: list[str]) -> None:
        """data.check_same_input of this rank's ``description`` of its global input against
        every rank's, then data.check_cache_files of the files its pipeline will write its
        cache to (two all-gathers on the engine: collective and blocking)."""
        data_lib.check_same_input(description, self._gather_input)
        data_lib.check_cache_files(cache_files, self._gather_input)

    def _gather_input(self, value) -> list:
        """Every rank's ``value`` (a control-plane all-gather labelled "input data": collective
        and blocking)."""
        return self.engine.call(lambda comm: comm.allgather(value), label="input data")

    def _distribute_datasets_from_function(self, dataset_fn, options):
        """``dataset_fn``'s dataset for this rank (an InputContext names it), cut to the
        shortest rank's length (data.end_together), so every rank runs the same number of
        steps. Collective and blocking (now), like every rank's call of this method; ValueError
        on every rank where ranks on one host would write one cache file
        (data.check_cache_files)."""
        del options
        context = distribute_lib.InputContext(num_input_pipelines=self._world.size,
                                              input_pipeline_id=self._world.rank,
                                              num_replicas_in_sync=self._world.size)
        dataset = dataset_fn(context)
        if not self._distributed:
            return data_lib.RankLocalDataset(dataset)
        data_lib.check_cache_files(data_lib.cache_files(dataset), self._gather_input)
        engine = self.engine

        def shortest(length: int) -> int:
            return engine.call(lambda comm: collectives.min_over_ranks(comm, length),
                               label="dataset length")
        return data_lib.RankLocalDataset(data_lib.end_together(dataset, shortest))

    def _experimental_distribute_values_from_function(self, value_fn):
        return value_fn(distribute_lib.ValueContext(self._world.rank, self._world.size))


class _PoseidonReplicaContext(distribute_lib.ReplicaContext):
    """The replica context ``run`` enters: replica id = rank, all-gather over the engine.

    ``local_batch``: this replica's example count in the step, when the gradient reduction is
    to weight each rank by its share of the global batch (Keras' compiled loss, a mean over the
    local batch: keras_integration's train step sets it with :meth:`weighting_by_batch_share`);
    None gives plain sums (custom loops, whose loss convention is already global).

    ``optimizer_applies_rows``: whether the optimizer about to apply the gradients being
    reduced updates an ``IndexedSlices`` gradient row by row in a way its dense sum would
    change (keras_integration sets it with :meth:`applying_rows`); then embedding gradients
    must reach it as every rank's rows, never summed densely.

    ``draw_window``: where this replica's rows sit in the step's global batch, when Keras'
    random draws are to take this rank's rows of the draw for the whole batch
    (batch_draws.py; set with :meth:`drawing_by_rows`: assumed by ``run`` for a batch
    argument, agreed by the ranks in keras_integration's train and test functions); None
    draws as Keras does.
    """

    def __init__(self, strategy: PoseidonStrategy, rank: int):
        super().__init__(strategy, replica_id_in_sync_group=rank)
        self.local_batch: tf.Tensor | None = None
        self.optimizer_applies_rows = False
        self.draw_window: batch_draws.RowsWindow | None = None

    def weighting_by_batch_share(self, local_batch: tf.Tensor | None):
        """Within it, gradient reductions in this replica weight it by ``local_batch``."""
        return self._setting("local_batch", local_batch)

    def applying_rows(self, one_by_one: bool):
        """Within it, ``optimizer_applies_rows`` is ``one_by_one``."""
        return self._setting("optimizer_applies_rows", one_by_one)

    def drawing_by_rows(self, window: batch_draws.RowsWindow | None):
        """Within it, ``draw_window`` is ``window``."""
        return self._setting("draw_window", window)

    @contextlib.contextmanager
    def _setting(self, name: str, value):
        outer = getattr(self, name)
        setattr(self, name, value)
        try:
            yield
        finally:
            setattr(self, name, outer)

    @property
    def devices(self):
        return self._strategy.extended.worker_devices

    def all_gather(self, value, axis, options=None):
        """Every rank's ``value`` (nested) concatenated along ``axis`` in rank order, every
        rank alike (a collective). Differentiable as TensorFlow's ``ReplicaContext.all_gather``
        is: the gradient of a rank's part is the sum over ranks of the gradients of the
        gathered tensor at that part's place (in-batch negatives drawn from every rank's rows
        train as in one process)."""
        del options
        extended = self._strategy.extended
        if not extended._distributed:
            return value
        return tf.nest.map_structure(
            lambda v: _differentiable_gather(extended, tf.convert_to_tensor(v), axis,
                                             self.replica_id_in_sync_group), value)


def _differentiable_gather(extended: PoseidonExtended, tensor: tf.Tensor, axis: int,
                           rank: int) -> tf.Tensor:
    """``extended.gather_along(tensor, axis)`` with TensorFlow's all-gather gradient: the
    upstream gradients summed over ranks (gathered and summed in rank order, so that their
    shape may be unknown when traced), then this rank's rows along ``axis``. Collective."""
    if tensor.shape.rank == 0:  # a scalar gathers as one row
        tensor, axis = tf.reshape(tensor, [1]), 0

    @tf.custom_gradient
    def gather(x):
        def grad(dy):
            summed = tf.reduce_sum(extended.gather_along(tf.convert_to_tensor(dy)[None], 0), 0)
            rows = tf.shape(x)[axis]
            counts = extended.gather_along(tf.reshape(rows, [1]), 0)
            offset = tf.reduce_sum(counts[:rank])
            return tf.gather(summed, tf.range(offset, offset + rows), axis=axis)
        return extended.gather_along(x, axis), grad

    return gather(tensor)


keras_integration.install(PoseidonStrategy)
