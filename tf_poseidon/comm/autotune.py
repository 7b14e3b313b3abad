"""Autotuning of the gradient reduction: during the first steps, measure, then keep the fastest.

Horovod's autotuner tunes its fusion buffer and cycle time by trying values over the first
steps; here a :class:`GradientTuner` tries, for the buckets of a training step's "gradients"
group (``PoseidonStrategy(autotune=True)``),

* **overlap** on or off: with overlap off the engine posts a step's first bucket only once
  every bucket of the step has been handed over (the backward pass is over), as
  ``overlap=False`` does — no communication competes with backprop for the cores;
* **the codec per bucket**, when the strategy's codec is a ``tunable`` one packed in float32
  (``compression="fp16"``; comm/codecs.py): that codec or the exact sum
  (``"none"``), bucket by bucket — a 16-bit codec halves the bytes but costs conversion
  passes, which a fast link does not repay. The exact sum is never replaced by a lossy one, and
  a codec of the user's own is kept. bf16 is kept too: its device form packs buckets in
  bfloat16 already (comm/datapath.py), which the exact sum cannot take, and the host and
  device forms must give the same sums.

Everything it changes happens on the engine thread (comm/engine.py), so trying a setting
needs no retrace: each step of the trial runs with one candidate, in a schedule that is the
same on every rank (it counts the group's instances, which every rank posts in the same
order). Trials, in rounds so that slow phases of the machine hit every candidate alike:

1. ``warmup`` steps with the default setting (codec as configured, overlap on), not timed;
2. every uniform candidate (each codec for all buckets × each overlap choice), ``rounds``
   times round-robin; each step's time is the time from its first bucket's hand-over to the
   next step's, and each bucket's time its collective's;
3. if the codec was tuned: the ranks agree on the per-bucket choice (the codec whose bucket
   time is lower, the slowest rank's median; ties go to the exact sum) and try that mixed
   setting with each overlap choice, ``rounds`` times;
4. the ranks agree on the setting whose median step time, on the slowest rank, is the least;
   it is used from then on.

The agreements are small all-reduces (MAX) on the engine thread at the start of a step, so
every rank chooses the same setting. The trials take ``warmup + rounds · (candidates)`` steps,
at most 2 + 3·6 = 20 (:func:`trial_steps`). A retrace that changes the buckets (another layout) starts its own
trials; what was tried and chosen is ``report()`` (``strategy.stats()["autotune"]``).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # imported where used: the benchmark suite reads trial_steps without TF
    from tf_poseidon.comm import codecs

DEFAULT_WARMUP = 2
DEFAULT_ROUNDS = 3
EXACT = "none"


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one step's gradient buckets run: ``overlap`` (False: post only once every bucket is
    there) and ``codecs``, the codec name of each bucket (None: each bucket's protocol's own)."""

    overlap: bool = True
    codecs: tuple[str, ...] | None = None

    def describe(self, configured: str) -> str:
        overlap = "overlap on" if self.overlap else "overlap off"
        names = self.codecs or ()
        if not names or set(names) == {configured}:
            return f"{overlap}, codec {configured}"
        if len(set(names)) == 1:
            return f"{overlap}, codec {names[0]}"
        counts = ", ".join(f"{names.count(n)} {n}" for n in sorted(set(names)))
        return f"{overlap}, codec per bucket ({counts})"


DEFAULT = Setting()


class _Trials:
    """The trials of one bucket layout (engine thread only)."""

    def __init__(self, layout: Sequence[tuple[str, int, str]], codec: "codecs.Codec",
                 overlaps: Sequence[bool], rounds: int, warmup: int):
        from tf_poseidon.comm.buckets import ALLREDUCE
        self.codec_names = [codec.name]
        # A lossy codec may give way to the exact sum on buckets summed on the host in float.
        self.may_be_exact = [kind == ALLREDUCE and dtype in ("float32", "float64")
                             for kind, _, dtype in layout]
        # A codec whose device form packs in its own 16 bits (bf16) cannot give way on the
        # device form's buckets, so, to give the two forms the same sums, on none.
        if (codec.tunable and codec.name != EXACT and any(self.may_be_exact)
                and np.dtype(codec.pack_dtype) == np.float32):
            self.codec_names.append(EXACT)
        self.configured = codec.name
        self.overlaps = list(overlaps)
        self.rounds, self.warmup = rounds, warmup
        self.num_buckets = len(layout)
        self.candidates: list[Setting] = []
        self.step_times: list[list[float]] = []
        self.bucket_times: dict[tuple[int, str], list[float]] = {}
        self.schedule: list[int] = [-1] * warmup  # -1: the default, untimed
        self._add([self._uniform(name) for name in self.codec_names])
        self.stage = "uniform"
        self.chosen: Setting | None = None
        self.current = -1
        self.started_at: float | None = None
        self.steps = 0
        self.medians: list[float] | None = None  # agreed median step times, once chosen

    def _uniform(self, name: str) -> tuple[str, ...]:
        return tuple(name if exact_ok else self.configured for exact_ok in self.may_be_exact)

    def _add(self, codec_choices: Sequence[tuple[str, ...]]) -> None:
        first = len(self.candidates)
        for names in codec_choices:
            for overlap in self.overlaps:
                self.candidates.append(Setting(overlap, names))
                self.step_times.append([])
        self.schedule += list(range(first, len(self.candidates))) * self.rounds

    def begin(self, comm, started_at: float) -> Setting:
        """A step starts (its first bucket's turn). Times the previous step; may agree with
        the other ranks (a collective) when a stage of the trials ends."""
        if self.started_at is not None and self.current >= 0:
            self.step_times[self.current].append(started_at - self.started_at)
        self.started_at = started_at
        self.steps += 1
        if self.chosen is None and not self.schedule:
            self._next_stage(comm)
        if self.chosen is not None:
            self.current = -1
            return self.chosen
        self.current = self.schedule.pop(0)
        return DEFAULT if self.current < 0 else self.candidates[self.current]

    def bucket_done(self, index: int, seconds: float) -> None:
        if self.current >= 0 and self.may_be_exact[index]:
            name = self.candidates[self.current].codecs[index]
            self.bucket_times.setdefault((index, name), []).append(seconds)

    def _next_stage(self, comm) -> None:
        if self.stage == "uniform" and len(self.codec_names) > 1:
            self.stage = "mixed"
            keys = [(i, name) for i in range(self.num_buckets) if self.may_be_exact[i]
                    for name in self.codec_names]
            slowest = _slowest(comm, [_median(self.bucket_times.get(k, [])) for k in keys])
            time_of = dict(zip(keys, slowest))
            mixed = tuple(min(self.codec_names, key=lambda n: (time_of[i, n], n != EXACT))
                          if self.may_be_exact[i] else self.configured
                          for i in range(self.num_buckets))
            if mixed not in {self._uniform(n) for n in self.codec_names}:
                self._add([mixed])
                return
        medians = _slowest(comm, [_median(t) for t in self.step_times])
        best = int(np.argmin(medians))
        self.chosen = self.candidates[best]
        self.medians = medians

    def report(self) -> dict:
        measured = self.medians or [_median(t) for t in self.step_times]
        return {
            "state": "chosen" if self.chosen is not None else f"measuring (step {self.steps})",
            "choice": self.chosen.describe(self.configured) if self.chosen else None,
            "candidates": [{"setting": c.describe(self.configured), "steps": len(t),
                            "median_step_s": None if not np.isfinite(m) else float(m)}
                           for c, t, m in zip(self.candidates, self.step_times, measured)],
        }


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("inf")


def _slowest(comm, values: Sequence[float]) -> list[float]:
    """Every rank: each value's maximum over the ranks (identical on every rank)."""
    from tf_poseidon.comm import collectives
    array = np.array(values, np.float64)
    if array.size:
        comm.Allreduce(collectives.mpi().IN_PLACE, array, op=collectives.mpi().MAX)
    return [float(v) for v in array]


def trial_steps(tuned_codec: bool, tune_overlap: bool = True, rounds: int = DEFAULT_ROUNDS,
                warmup: int = DEFAULT_WARMUP) -> int:
    """The most steps the trials of one bucket layout take before the choice: the warm-up,
    then ``rounds`` of every candidate (the mixed ones included)."""
    overlaps = 2 if tune_overlap else 1
    codecs_tried = 3 if tuned_codec else 1  # the codec, the exact sum, the mix
    return warmup + rounds * overlaps * codecs_tried


class GradientTuner:
    """Chooses the engine-side setting of the gradients group's buckets (module docstring).

    ``codec``: the strategy's codec; ``tune_overlap``: whether overlap off is a candidate
    (not when the user set ``overlap=False``: the graph then waits for the backward pass by
    itself). ``begin`` and ``bucket_done`` run on the engine thread only; ``report`` on any.
    """

    def __init__(self, codec: "codecs.Codec", tune_overlap: bool = True,
                 rounds: int = DEFAULT_ROUNDS, warmup: int = DEFAULT_WARMUP):
        if rounds < 1 or warmup < 0:
            raise ValueError(f"GradientTuner needs rounds >= 1 and warmup >= 0, got "
                             f"rounds={rounds}, warmup={warmup}")
        self.codec = codec
        self._overlaps = [True, False] if tune_overlap else [True]
        self._rounds, self._warmup = rounds, warmup
        self._trials: dict[tuple, _Trials] = {}
        self._lock = threading.Lock()

    def begin(self, comm, layout: tuple, started_at: float) -> Setting:
        """Engine thread, when a step of a group with bucket ``layout`` ((kind, payload
        bytes, dtype name) per bucket) reaches its turn, before its first bucket is posted;
        ``started_at`` is when its first bucket was handed over. The same step on every rank;
        may run a small all-reduce (the agreement), so every rank must call it there."""
        with self._lock:
            trials = self._trials.get(layout)
            if trials is None:
                trials = self._trials[layout] = _Trials(layout, self.codec, self._overlaps,
                                                        self._rounds, self._warmup)
        return trials.begin(comm, started_at)

    def bucket_done(self, layout: tuple, index: int, seconds: float) -> None:
        """Engine thread: bucket ``index`` of the current step of ``layout`` took
        ``seconds``."""
        trials = self._trials.get(layout)
        if trials is not None:
            trials.bucket_done(index, seconds)

    def codec_of(self, setting: Setting, index: int) -> "codecs.Codec | None":
        """The codec bucket ``index`` runs with under ``setting``: None for its protocol's
        own (the strategy's codec, whose wire buffers are the protocol's), else the exact
        sum."""
        if setting.codecs is None or setting.codecs[index] == self.codec.name:
            return None
        from tf_poseidon.comm import codecs
        return codecs.get(setting.codecs[index])

    def report(self) -> list[dict]:
        """Per bucket layout tuned so far: its state, choice and candidates with the median
        step time measured (the slowest rank's, once agreed)."""
        with self._lock:
            return [trials.report() for trials in self._trials.values()]
