"""Elastic averaging SGD (mode="easgd"; Zhang, Choromanska, LeCun 2015), synchronous and async.

Every rank takes optimizer steps on its own data with its own gradients (no gradient
communication: ``reduce_gradients`` returns the mean-loss gradient of the local batch). Every
``tau`` of its steps, right after the optimizer's update, a rank moves elastically towards the
*center* c, a copy of the trainable variables that is what users evaluate, predict with, save
and export:

* synchronous (``easgd_async=False``; every rank keeps a copy of c, no server): on the same
  steps on every rank, d_p = α(x_p − c); x_p ← x_p − d_p; c ← c + Σ_p d_p, one all-reduce of
  the d_p through the engine (in buckets, like gradients). Needs α·P < 1
  (:meth:`EASGD.validate`; the default α is 0.9/P): the center moves by α·P times the ranks'
  mean distance from it per period.
* asynchronous (``easgd_async=True``; Theano-MPI's form): c lives with a holder thread on rank
  0 (easgd_center.py); each rank, every τ of its *own* steps, exchanges with it alone:
  d = α(x_p − c); x_p ← x_p − d; c ← c + d. No rank waits for another during training, so
  ranks that diverge (TerminateOnNaN, a callback, stopping training on one rank only) would
  post no collective that the engine's agreement could compare until the next meeting; an
  exchange checks instead that no rank has drained at a step this rank has trained past
  (easgd_center.DrainNotices) and, if one has, joins that rank's meeting with a call labelled
  :data:`EXCHANGE`: the agreement fails on every rank, naming both sides.

What users see (docs/easgd.md): ``consistent_state()`` swaps the center into the model's
trainable variables on every rank (the async form first fetches it from rank 0 and broadcasts
it) and restores each rank's local weights on exit; the Keras integration enters it around
``evaluate`` and ``predict``, and checkpoints and exports go through it. ``drain()`` — called at
the end of ``fit`` — makes the center every rank's weights (x_p ← c), so after ``fit`` the
model is the center, identical on every rank, and further training starts from it: the first
step after a drain restarts the center from rank 0's weights, so weights loaded or set between
two ``fit`` calls are where the next one starts.

State: per *group* (the trainable variables one optimizer updates, i.e. one model) a step
counter (a tf.Variable, so ``steps_per_execution`` loops count right; it keeps counting
across ``fit`` calls), a restart flag and, in the synchronous form, the center's non-trainable
tf.Variables; all are created, outside any Keras model, when the train step is first traced
(``reduce_gradients``, before the first update: so the center starts from the weights rank 0
broadcast before the first step, or those BackupAndRestore restored). Non-trainable
variables (BatchNorm's moving statistics) are not elastic: each rank keeps its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_poseidon import timeouts
from tf_poseidon.algorithms import easgd_center
from tf_poseidon.algorithms.base import (Algorithm, AlgorithmContext, AlgorithmImpl,
                                         variable_names)
from tf_poseidon.algorithms.registry import register
from tf_poseidon.comm import codecs
from tf_poseidon.comm.collectives import as_mpi_buffer
from tf_poseidon.comm.protocol import AllReduce


@dataclasses.dataclass
class _Group:
    """The elastic state of one set of trainable variables (one model's)."""

    index: int
    variables: list[tf.Variable]
    names: list[str]
    dtype: np.dtype              # the flat vector's dtype (async form)
    sizes: list[int]
    step: tf.Variable            # this rank's optimizer steps since the group was created
    reseed: tf.Variable          # True after a drain: the next step restarts the center
    centers: list[tf.Variable]   # synchronous form: this rank's copy of c; async: empty

    @property
    def num_elements(self) -> int:
        return sum(self.sizes)


ASYNC_DEFAULT_ALPHA = 0.5  # Theano-MPI's
SYNC_DEFAULT_ALPHA_TIMES_P = 0.9  # Zhang et al.'s β = α·P
MOVE, RESEED = "easgd", "easgd_reseed"  # the synchronous form's collective groups
EXCHANGE = "an asynchronous EASGD exchange (training)"
"""The engine call of an exchange that found a rank drained at a step it has trained past."""
DRAIN_MEETING = "the asynchronous EASGD meeting of a drain (the end of fit)"
MEETING = "the asynchronous EASGD meeting of all ranks"


@register
class EASGD(Algorithm):
    """Elastic averaging SGD: local steps, and every ``tau`` steps an elastic move of moving
    rate ``alpha`` towards the center (module docstring; docs/easgd.md).

    Args:
      tau: the period in steps, an int >= 1.
      alpha: the moving rate in (0, 1]. Default: 0.9/P for the synchronous form (α·P = 0.9,
        Zhang et al.'s β; the synchronous form needs α·P < 1), 0.5 for the asynchronous one.
      easgd_async: the asynchronous form (a center holder on rank 0) instead of the
        synchronous one.
    """

    name = "easgd"
    lockstep = False
    training_groups = (MOVE, RESEED, EXCHANGE)

    def __init__(self, tau: int = 1, alpha: float | None = None, easgd_async: bool = False):
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 1:
            raise ValueError(f"PoseidonStrategy: tau={tau!r} is not valid; the EASGD "
                             "period must be an integer >= 1 (steps between elastic moves).")
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                                  or not 0.0 < alpha <= 1.0):
            raise ValueError(f"PoseidonStrategy: alpha={alpha!r} is not valid; the EASGD "
                             "moving rate must be a number in (0, 1].")
        if not isinstance(easgd_async, bool):
            raise ValueError(f"PoseidonStrategy: easgd_async={easgd_async!r} is not "
                             "valid; allowed values are True and False.")
        self.tau, self.alpha, self.easgd_async = tau, alpha, easgd_async

    @property
    def asynchronous(self) -> bool:
        return self.easgd_async

    def options(self) -> dict:
        return {"tau": self.tau, "alpha": self.alpha, "easgd_async": self.easgd_async}

    def alpha_for(self, num_replicas: int) -> float:
        """The moving rate used on ``num_replicas`` ranks (the given one, or the default)."""
        if self.alpha is not None:
            return float(self.alpha)
        if self.easgd_async:
            return ASYNC_DEFAULT_ALPHA
        return SYNC_DEFAULT_ALPHA_TIMES_P / max(num_replicas, 1)

    def validate(self, num_replicas: int) -> None:
        """Synchronous EASGD moves the center by α·P times the ranks' mean distance from it
        each period: α·P must be < 1 (Zhang et al.'s β = α·P), or it overshoots and
        oscillates."""
        alpha = self.alpha_for(num_replicas)
        if self.easgd_async or num_replicas < 2 or alpha * num_replicas < 1.0:
            return
        raise ValueError(
            f"PoseidonStrategy: alpha={alpha!r} is not valid for synchronous EASGD on "
            f"{num_replicas} ranks: alpha·P = {alpha * num_replicas:g}, and it must be < 1 "
            "(each period the center moves by alpha·P times the ranks' mean distance from it; "
            f"at 1 or more it jumps to or past their mean and oscillates). Use alpha < "
            f"1/{num_replicas}, e.g. alpha={0.9 / num_replicas:.3g} (alpha·P = 0.9, as Zhang "
            "et al.; the default when alpha is not given), or easgd_async=True.")

    def reify(self, context: AlgorithmContext) -> "EASGDImpl":
        return EASGDImpl(context, self.tau, self.alpha_for(context.num_replicas),
                         self.easgd_async)


class EASGDImpl(AlgorithmImpl):
    """``EASGD`` at runtime: local steps, and an elastic move towards the center every τ steps.

    Built by the strategy (lazily, while the first replica function is traced, on every rank
    at the same point). The asynchronous form duplicates the engine's communicator there (a
    collective, run on the engine thread so it is ordered with the engine's other work) and,
    on rank 0, creates the center holder.
    """

    def __init__(self, context: AlgorithmContext, tau: int, alpha: float, asynchronous: bool):
        super().__init__(context)
        engine = context.engine
        self.tau = tau
        self.alpha = alpha
        self.asynchronous = asynchronous
        self._exact = AllReduce(codecs.get("none"))
        self._groups: dict[tuple, _Group] = {}
        self._swap_depth = 0
        self.counters = easgd_center.ExchangeCounters()
        self._holder = self._client = self._drains = None
        if asynchronous:
            from mpi4py import MPI
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise RuntimeError("tf_poseidon: asynchronous EASGD needs an MPI library with "
                                   "MPI_THREAD_MULTIPLE (the center holder's thread and the "
                                   "engine's use MPI at the same time).")
            comm = engine.call(lambda world_comm: world_comm.Dup(), label="EASGD communicator")
            self._drains = easgd_center.DrainNotices(comm)
            if engine.rank == easgd_center.HOLDER_RANK:
                self._holder = easgd_center.CenterHolder(comm, self.alpha)
            else:
                self._client = easgd_center.CenterClient(comm)

    # -- the contract ------------------------------------------------------------------------

    def reduce_gradients(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable],
                         local_batch: tf.Tensor | None) -> list[tf.Tensor]:
        """Replica context: the gradient of the mean loss over this rank's batch (no
        communication). ``local_batch`` is ignored: each rank steps on its own batch.

        Also, on the first step after a ``drain`` (so: of every ``fit`` after the first), the
        center restarts from rank 0's weights before this step's update — weights loaded or
        set between two ``fit`` calls are the new starting point, not the old center (sync:
        one all-reduce every rank joins; async: rank 0 resets the center it holds)."""
        del local_batch
        group = self._group_for(list(variables))
        tf.cond(group.reseed, lambda: self._reseed(group), lambda: tf.constant(0, tf.int64))
        return self.local_mean(grads)

    def after_update(self, variables: Sequence[tf.Variable]) -> None:
        """Replica context, after the optimizer's update: counts the step and, on every τ-th,
        makes the elastic move (sync: an all-reduce every rank joins; async: an exchange with
        rank 0 that blocks this rank's step only, at most the collective timeout, or raises
        CollectiveMismatchError when another rank has finished the fit: module docstring)."""
        group = self._group_for(list(variables))  # made by reduce_gradients, as a rule
        step = group.step.assign_add(1)
        move = self._move_async if self.asynchronous else self._move_sync
        if self.tau == 1:
            move(group)
            return

        def elastic() -> tf.Tensor:
            move(group)
            return tf.constant(0, tf.int64)
        # Every rank takes the same branch in the synchronous form (same step count), so the
        # all-reduce inside is joined by all; the Sequencer orders it with the other ops.
        tf.cond(tf.equal(step % self.tau, 0), elastic, lambda: tf.constant(0, tf.int64))

    def drain(self) -> None:
        """Every rank, eagerly (collective in the async form): x_p ← c for every group, so all
        ranks hold the center. Called at the end of ``fit``. The next training step restarts
        the center from rank 0's weights then (see ``reduce_gradients``). The async form first
        tells the other ranks at which step this one drains (easgd_center.DrainNotices)."""
        groups = self._ordered_groups()
        if self._drains is not None:
            self._drains.announce(max((int(g.step.numpy()) for g in groups), default=0))
        for group, center in zip(groups, self._center_values(DRAIN_MEETING)):
            for variable, value in zip(group.variables, center):
                variable.assign(value)
            group.reseed.assign(True)

    @contextlib.contextmanager
    def consistent_state(self):
        """Every rank, eagerly: within it the model's trainable variables hold the center, equal
        on every rank; on exit each rank's local weights are back. Collective in the async form
        (a barrier, then rank 0 broadcasts the center it holds); re-entrant (only the outermost
        swaps). Before the first train step there is no center yet: the weights are rank 0's
        broadcast ones, and nothing is swapped."""
        if self._swap_depth:
            self._swap_depth += 1
            try:
                yield
            finally:
                self._swap_depth -= 1
            return
        groups = self._ordered_groups()
        centers = self._center_values(MEETING)
        local = [[v.numpy() for v in g.variables] for g in groups]
        for group, center in zip(groups, centers):
            for variable, value in zip(group.variables, center):
                variable.assign(value)
        self._swap_depth = 1
        try:
            yield
        finally:
            self._swap_depth = 0
            for group, values in zip(groups, local):
                for variable, value in zip(group.variables, values):
                    variable.assign(value)

    # -- observability ----------------------------------------------------------------------

    def stats(self) -> dict:
        """``strategy.stats()["mode"]``: the form, τ, α, and this rank's exchange counters
        (async: exchanges, bytes its worker sent and received, seconds it waited; on rank 0
        also ``served``, the holder's answers to the other ranks). The synchronous form's
        all-reduces are the engine's group "easgd" (bytes in ``strategy.stats()``'s records)."""
        report = {"form": "async" if self.asynchronous else "sync", "tau": self.tau,
                  "alpha": self.alpha, **self.counters.as_dict()}
        if self._holder is not None:
            report["served"] = self._holder.served.as_dict()
        return report

    # -- groups, centers -------------------------------------------------------------------

    def _ordered_groups(self) -> list[_Group]:
        return sorted(self._groups.values(), key=lambda g: g.index)

    def _group_for(self, variables: list[tf.Variable]) -> _Group:
        key = tuple(v.ref() for v in variables)
        group = self._groups.get(key)
        if group is not None:
            return group
        index = len(self._groups)
        with tf.init_scope():  # plain eager variables, also when called while tracing
            step = tf.Variable(0, dtype=tf.int64, trainable=False, name=f"easgd_step_{index}")
            reseed = tf.Variable(False, trainable=False, name=f"easgd_reseed_{index}")
            values = [v.numpy() for v in variables]
            centers = [] if self.asynchronous else [
                tf.Variable(value, trainable=False, name=f"easgd_center_{index}_{i}")
                for i, value in enumerate(values)]
        dtype = np.result_type(*[v.dtype for v in values]) if values else np.dtype("float32")
        group = _Group(index, variables, variable_names(variables), dtype,
                       [int(np.size(v)) for v in values], step, reseed, centers)
        if self._holder is not None:
            self._holder.register(index, _flatten(values, dtype))
        self._groups[key] = group
        return group

    def _center_values(self, meeting: str) -> list[list[np.ndarray]]:
        """Every group's center as numpy arrays shaped like its variables (eager; the async
        form fetches it at the meeting of all ranks labelled ``meeting``)."""
        groups = self._ordered_groups()
        if not self.asynchronous:
            return [[c.numpy() for c in g.centers] for g in groups]
        holder = self._holder

        def fetch(comm) -> list[np.ndarray]:
            comm.Barrier()  # every rank's exchanges are done (a worker waits for its reply)
            flats = []
            for g in groups:
                flat = holder.snapshot(g.index) if holder is not None \
                    else np.empty(g.num_elements, g.dtype)
                comm.Bcast(as_mpi_buffer(flat), root=easgd_center.HOLDER_RANK)
                flats.append(flat)
            return flats
        # A meeting point: the ranks, each at its own pace, wait here for the slowest.
        flats = timeouts.engine_call(self.engine, fetch, timeouts.meeting_s(), meeting,
                                     "TF_POSEIDON_MEETING_TIMEOUT")
        return [_unflatten(flat, g) for flat, g in zip(flats, groups)]

    # -- graph ops ---------------------------------------------------------------------------

    def _reseed(self, group: _Group) -> tf.Tensor:
        """c ← rank 0's weights (every rank: the same branch, after the same drain)."""
        if self.asynchronous:
            if self._holder is not None:
                holder, dtype = self._holder, group.dtype

                def reset(*arrays: np.ndarray) -> np.int64:
                    holder.set_center(group.index, _flatten(arrays, dtype))
                    return np.int64(0)
                done = tf.numpy_function(reset, [v.read_value() for v in group.variables],
                                         tf.int64, stateful=True, name="tp_easgd_reseed")
                with tf.control_dependencies([done]):
                    group.reseed.assign(False)
            else:
                group.reseed.assign(False)
            return tf.constant(0, tf.int64)
        mine = [v.read_value() for v in group.variables]
        if self.engine.rank != 0:
            mine = [tf.zeros_like(x) for x in mine]
        rank0 = self.sum_over_ranks(RESEED, mine, group.names, self._exact)
        for center, value in zip(group.centers, rank0):
            center.assign(value)
        group.reseed.assign(False)
        return tf.constant(0, tf.int64)

    def _move_sync(self, group: _Group) -> None:
        alpha = self.alpha
        differences = [tf.cast(alpha, v.dtype) * (v.read_value() - c.read_value())
                       for v, c in zip(group.variables, group.centers)]
        # May travel in 16 bits: summed in float32, the same result on every rank, so the
        # centers stay equal. The async exchange and the center's restart are never compressed.
        total = self.sum_over_ranks(MOVE, differences, group.names)
        for variable, center, d, summed in zip(group.variables, group.centers, differences,
                                               total):
            variable.assign_sub(d)
            center.assign_add(summed)

    def _move_async(self, group: _Group) -> None:
        count, dtype, index = len(group.variables), group.dtype, group.index
        holder, client, counters = self._holder, self._client, self.counters

        def exchange(step: np.int64, *arrays: np.ndarray) -> np.ndarray:
            if self._drains.passed(int(step)):
                # They wait at DRAIN_MEETING: this call's agreement fails there and here, on
                # every rank, with CollectiveMismatchError naming both sides.
                self.engine.call(lambda comm: None, timeouts.meeting_s(), label=EXCHANGE)
            x = _flatten(arrays[:count], dtype)
            if holder is not None:
                d = holder.exchange(index, x)
                counters.exchanges += 1
                return d
            return client.exchange(index, x, counters)

        def make(extra):
            inputs = [group.step.read_value()] + [v.read_value() for v in group.variables]
            flat = tf.numpy_function(exchange, inputs + extra, tf.as_dtype(dtype),
                                     stateful=True, name="tp_easgd_exchange")
            flat.set_shape([group.num_elements])
            return flat
        flat = self.sequencer.run_in_order(make)
        pieces = tf.split(flat, group.sizes) if count > 1 else [flat]
        for variable, piece in zip(group.variables, pieces):
            variable.assign_sub(tf.reshape(tf.cast(piece, variable.dtype), variable.shape))


def _flatten(values: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """One new contiguous vector of ``values`` in ``dtype``."""
    if not values:
        return np.empty(0, dtype)
    return np.concatenate([np.asarray(v).astype(dtype, copy=False).ravel() for v in values])


def _unflatten(flat: np.ndarray, group: _Group) -> list[np.ndarray]:
    out, offset = [], 0
    for variable, n in zip(group.variables, group.sizes):
        piece = flat[offset:offset + n].reshape(variable.shape.as_list())
        out.append(piece.astype(variable.dtype.as_numpy_dtype, copy=False))
        offset += n
    return out
