"""How long a rank waits for its peers, by phase of the job (docs/failures.md has the table).

One timeout cannot fit every wait: a training step's collective should fail within minutes
when a peer hangs, but the first meeting of the ranks waits for the slowest one to build its
model (and the op library), a large model's initial broadcast takes as long as its bytes need,
rank 0 may write a checkpoint for many minutes while the others wait, and asynchronous EASGD's
ranks run at their own pace between the points where they meet. So each phase has its own:

==========================  =================================================================
phase                       limit
==========================  =================================================================
step collectives            :func:`step_s`: ``TF_POSEIDON_TIMEOUT`` (default 120 s)
first meeting               :func:`start_s`: ``TF_POSEIDON_START_TIMEOUT`` (default 600 s)
initial broadcast           :func:`broadcast_s`: the step timeout + 1 s per 10 MB
work on rank 0 only         heartbeats: silent for the step timeout, or longer than
                            :func:`chief_s` (``TF_POSEIDON_CHIEF_TIMEOUT``, default 3600 s)
async EASGD meeting points  :func:`meeting_s`: ``TF_POSEIDON_MEETING_TIMEOUT`` (default 3600 s)
end of the program          heartbeats from the ranks not there yet: silent for the step
                            timeout, or longer than :func:`meeting_s` (comm/engine.py)
==========================  =================================================================

A rank whose process dies is not a timeout's business: Open MPI's launcher notices the exit
and ends the job within seconds. The limits catch ranks that are alive but stuck (or run a
different program). Every function reads the environment at each call; a value that is not a
positive number raises ValueError naming the variable.

This module sits below the engine (comm/engine.py reads its limits here), so it imports nothing
of the engine's: :func:`engine_call` and :func:`meet` take the engine as an argument.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

from tf_poseidon.comm.agreement import EPOCH_END_MEETING
from tf_poseidon.comm.errors import CollectiveTimeoutError

if TYPE_CHECKING:
    from tf_poseidon.comm.engine import CommEngine

DEFAULT_STEP_S = 120.0
DEFAULT_START_S = 600.0
DEFAULT_CHIEF_S = 3600.0
DEFAULT_MEETING_S = 3600.0
BROADCAST_FLOOR_BYTES_PER_S = 10e6
"""The slowest rate the initial broadcast is granted (about a 100 Mbit/s link's)."""


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: give a positive number of seconds.")
    return value


def step_s() -> float:
    """Any wait for a collective of training, evaluation or prediction; also how long rank 0
    may stay silent during work only it does (``TF_POSEIDON_TIMEOUT``, default 120 s)."""
    return _seconds("TF_POSEIDON_TIMEOUT", DEFAULT_STEP_S)


def start_s() -> float:
    """The first meeting of the ranks (the check that they built the same variables): it
    waits for the slowest rank to import, build its model, load its data and, on first use,
    build the op library (``TF_POSEIDON_START_TIMEOUT``, default 600 s)."""
    return _seconds("TF_POSEIDON_START_TIMEOUT", DEFAULT_START_S)


def broadcast_s(num_bytes: int) -> float:
    """The broadcast of ``num_bytes`` of initial values from rank 0: the step timeout plus
    one second per 10 MB."""
    return step_s() + num_bytes / BROADCAST_FLOOR_BYTES_PER_S


def chief_s() -> float:
    """The longest the other ranks wait for work rank 0 does alone (a checkpoint, an export),
    however steadily its heartbeats come (``TF_POSEIDON_CHIEF_TIMEOUT``, default 3600 s)."""
    return _seconds("TF_POSEIDON_CHIEF_TIMEOUT", DEFAULT_CHIEF_S)


def meeting_s() -> float:
    """Asynchronous EASGD's meeting points (end of an epoch or of ``fit``, evaluate,
    checkpoints), where the ranks, each at its own pace, wait for the slowest; also the
    longest a rank at the end of its program waits for the others, however steadily they
    send heartbeats (``TF_POSEIDON_MEETING_TIMEOUT``, default 3600 s)."""
    return _seconds("TF_POSEIDON_MEETING_TIMEOUT", DEFAULT_MEETING_S)


def engine_call(engine: "CommEngine", fn: Callable[[Any], Any], timeout_s: float,
                what: str, setting: str) -> Any:
    """``engine.call(fn, timeout_s)``, whose timeout names ``what`` timed out and the
    ``setting`` that bounds it. Collective and blocking, like ``CommEngine.call``."""
    try:
        return engine.call(fn, timeout_s=timeout_s, label=what)
    except CollectiveTimeoutError:
        raise CollectiveTimeoutError(
            f"tf_poseidon: {what} did not complete within {timeout_s:.0f} s ({setting}). A "
            "peer rank hangs or runs a different program.") from None


def meet(engine: "CommEngine") -> None:
    """Every rank: blocks until every rank has called it, for at most :func:`meeting_s`.

    For ranks that step at their own pace (asynchronous EASGD, SSP) before a collective that
    every rank joins at a point of the program rather than of training (the metrics at an
    epoch's end): the collective that follows then waits no longer than a step's.
    """
    engine_call(engine, lambda comm: comm.Barrier(), meeting_s(), EPOCH_END_MEETING,
                "TF_POSEIDON_MEETING_TIMEOUT")
