"""Where a training step's time goes: per-phase timers for a few steps of ``fit``.

:class:`StepProfiler` is a Keras callback. For ``steps`` batches starting at ``first_step`` of
the first epoch it records a TensorFlow profiler trace (the *timeline*: open ``logdir`` in
TensorBoard's profiler) and the engine's bucket records, and turns both into a
:class:`StepProfile`: seconds per step of each phase of the gradient's path
(docs/architecture.md, "One gradient's path"):

=====================  ==================================================================
phase                  what it times
=====================  ==================================================================
``compute``            every TensorFlow op that is not one of the phases below: the
                       model's forward and backward pass, the optimizer, casts and
                       batch-share weighting
``enqueue``            the enqueue ops (comm/graph_ops.py): TensorFlow's hand-over of the
                       bucket's tensors to Python (``numpy_function``), the protocol's
                       ``pack`` (the copy into the payload) and the hand-over to the engine
``collect``            the collect ops: waiting for the engine's result, then its pieces
                       as the op's outputs (this is the communication the step could not
                       hide behind computation)
``device_pack``        ``ops.pack`` / ``ops.unpack`` (the device form of a bucket,
                       comm/datapath.py)
``sfb_reconstruct``    ``ops.sfb_reconstruct``: gradients rebuilt from sufficient factors
``wire``               the engine thread's collectives (comm/engine.py), codec work on the
                       engine thread included: runs beside the TensorFlow threads
``engine_queue``       how long buckets waited in the engine's queue before being posted
                       (behind earlier buckets, or for their turn), summed over the
                       step's buckets: it exceeds the step when many buckets queue
=====================  ==================================================================

TensorFlow phases are *self* times of op events (an op's time minus the ops nested in it)
summed over TensorFlow's threads, so with several inter-op threads their sum may exceed the
step's wall time (``step_s``); ``wire`` and ``engine_queue`` come from the engine's records of
the profiled steps. The profiler costs a little time itself: profile steps that are not timed.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import tempfile
import time

import keras

PHASES = ("compute", "enqueue", "collect", "device_pack", "sfb_reconstruct", "wire",
          "engine_queue")

# An op's event: its name (no spaces or colons) and type; not "EagerLocalExecute: __inference_f"
# (the eager call of a whole function) nor "ExecutorState::Process".
_OP_EVENT = re.compile(r"([^\s:]+):([A-Za-z_][A-Za-z0-9_]*)")
_OP_PHASES = {"PoseidonPack": "device_pack", "PoseidonUnpack": "device_pack",
              "PoseidonSfbReconstruct": "sfb_reconstruct"}


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """Seconds per step of each phase (module docstring), over ``steps`` profiled steps."""

    steps: int
    step_s: float  # wall time per step on this rank
    phases: dict[str, float]
    logdir: str | None = None  # the profiler trace, when it was kept

    def as_dict(self) -> dict:
        return {"steps": self.steps, "step_s": self.step_s, "phases": dict(self.phases)}

    def table(self) -> str:
        """The phases as a small text table (ms per step and share of the step)."""
        rows = [f"{'phase':<16} {'ms/step':>9} {'of step':>8}"]
        for name in PHASES:
            seconds = self.phases.get(name, 0.0)
            share = seconds / self.step_s if self.step_s else float("nan")
            rows.append(f"{name:<16} {seconds * 1e3:>9.1f} {share:>8.0%}")
        rows.append(f"{'step (wall)':<16} {self.step_s * 1e3:>9.1f}")
        return "\n".join(rows)


def op_phase(event_name: str) -> str | None:
    """The phase of a profiler event named ``"<op name>:<op type>"``, or None for events
    that are not TensorFlow ops (executor bookkeeping, Python frames)."""
    match = _OP_EVENT.fullmatch(event_name)
    if match is None:
        return None
    name, op_type = match.groups()
    if "tp_enqueue_" in name:
        return "enqueue"
    if "tp_collect_" in name:
        return "collect"
    return _OP_PHASES.get(op_type, "compute")


def trace_phases(logdir: str) -> dict[str, float]:
    """Seconds of self time per phase of every TensorFlow op event in the newest profiler
    trace (``*.xplane.pb``) under ``logdir``. Raises FileNotFoundError when there is none."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"no profiler trace (*.xplane.pb) under {logdir}")
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    totals: dict[str, float] = collections.defaultdict(float)
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            events = sorted((e.offset_ps, e.offset_ps + e.duration_ps, op_phase(names.get(
                e.metadata_id, ""))) for e in line.events)
            for phase, seconds in _self_times(events):
                totals[phase] += seconds
    return dict(totals)


def _self_times(events):
    """(phase, self seconds) of every op event of one thread line: its duration minus the op
    events nested in it. ``events``: (start ps, end ps, phase or None) sorted by start."""
    stack: list[list] = []  # [end, phase, nested op ps]

    def close(entry):
        end, phase, start, nested = entry
        return phase, max(0, end - start - nested) / 1e12

    for start, end, phase in events:
        while stack and stack[-1][0] <= start:
            yield close(stack.pop())
        if phase is None:
            continue
        if stack:
            stack[-1][3] += end - start
        stack.append([end, phase, start, 0])
    while stack:
        yield close(stack.pop())


def engine_phases(records, since: float, until: float) -> dict[str, float]:
    """Seconds of ``wire`` and ``engine_queue`` of the engine's bucket records (comm/stats.py)
    that started within [since, until] (``time.perf_counter()`` times)."""
    wire = queue = 0.0
    for r in records:
        if since <= r.start <= until:
            wire += r.end - r.start
            queue += r.start - r.queued_at
    return {"wire": wire, "engine_queue": queue}


class StepProfiler(keras.callbacks.Callback):
    """Profiles ``steps`` training batches of ``fit`` from batch ``first_step`` of the first
    epoch (every rank; each rank profiles its own process).

    After the last profiled batch, ``profile`` holds the :class:`StepProfile` (None before, or
    when the epoch ended first) and rank 0 prints its table unless ``verbose=False``. The
    trace stays in ``logdir`` (default: a temporary directory, removed afterwards). Runs on
    the thread that runs ``fit``; stopping the profiler and reading the trace take a second
    or two, outside the profiled steps.
    """

    def __init__(self, first_step: int = 2, steps: int = 3, logdir: str | None = None,
                 verbose: bool = True):
        super().__init__()
        if first_step < 0 or steps < 1:
            raise ValueError(f"StepProfiler needs first_step >= 0 and steps >= 1, got "
                             f"first_step={first_step}, steps={steps}")
        self.first_step, self.steps, self.verbose = first_step, steps, verbose
        self._logdir, self._temporary = logdir, None
        self._start = None
        self._done = False
        self.profile: StepProfile | None = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._done or batch != self.first_step or self._start is not None:
            return
        import tensorflow as tf
        if self._logdir is None:
            self._temporary = tempfile.TemporaryDirectory(prefix="tp_profile_")
        tf.profiler.experimental.start(self._logdir or self._temporary.name)
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._start is None or self._done or batch != self.first_step + self.steps - 1:
            return
        end = time.perf_counter()
        self._finish(end)

    def on_epoch_end(self, epoch, logs=None):
        if self._start is not None and not self._done:  # the epoch ended first
            self._finish(None)

    def _finish(self, end: float | None) -> None:
        import tensorflow as tf
        tf.profiler.experimental.stop()
        self._done = True
        logdir = self._logdir or self._temporary.name
        try:
            if end is None:
                return
            phases = {name: 0.0 for name in PHASES}
            for name, seconds in trace_phases(logdir).items():
                phases[name] += seconds
            engine = _engine_or_none(self.model)
            if engine is not None:
                phases.update(engine_phases(engine.stats.records(), self._start, end))
            per_step = {name: seconds / self.steps for name, seconds in phases.items()}
            self.profile = StepProfile(self.steps, (end - self._start) / self.steps, per_step,
                                       self._logdir)
            from tf_poseidon import world
            if self.verbose and world.is_chief():
                print(f"tf_poseidon step profile (rank 0, {self.steps} steps):\n"
                      f"{self.profile.table()}", flush=True)
        finally:
            if self._temporary is not None:
                self._temporary.cleanup()


def _engine_or_none(model):
    """The engine of the strategy ``model`` was built under, if it is a multi-rank
    PoseidonStrategy (else None: no communication to time)."""
    strategy = getattr(model, "distribute_strategy", None)
    extended = getattr(strategy, "extended", None)
    if extended is None or not getattr(extended, "_distributed", False):
        return None
    return extended.engine
