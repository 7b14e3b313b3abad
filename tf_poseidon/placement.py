"""One process per device: which GPU a rank uses, and how many CPU threads TensorFlow may use.

Rules (applied only when the job has more than one process, on this host or in all; a plain
``python train.py`` keeps TensorFlow's defaults):

- **GPU hosts**: local rank r sees only GPU r — the r-th entry of ``CUDA_VISIBLE_DEVICES`` if
  the user set it (wrapping around if there are fewer entries than local ranks), else GPU r.
  Before TensorFlow is imported this is done with ``CUDA_VISIBLE_DEVICES``; after, with
  ``tf.config.set_visible_devices``. Thread pools keep TF's defaults.
- **CPU-only hosts**: the cores this process may run on (``os.sched_getaffinity``) are shared
  by the ranks of the host: intra-op threads = max(1, cores // local_size); inter-op threads =
  2. Under ``srun --cpus-per-task=N`` the N CPUs are the task's own: intra-op threads = N.
  ``TF_POSEIDON_INTRA_THREADS`` / ``TF_POSEIDON_INTER_THREADS`` override the two numbers.
  The division assumes the ranks are not bound to cores by the launcher (``tfposeidon-run``
  passes ``--bind-to none``; plain ``mpirun`` binds by default — pass ``--bind-to none``).
  The inter-op pool is never made smaller than 2: the communication engine's graph ops run on
  it and a single inter-op thread starves them.
- **The user's own settings win**: ``TF_NUM_INTRAOP_THREADS``/``TF_NUM_INTEROP_THREADS`` in the
  environment, and ``tf.config.threading.set_*`` calls (made before or after this).
- If TensorFlow's runtime is already initialised, the pools (and visible GPUs) can no longer
  change; that is reported in :attr:`Placement.notes` and logged, not raised.

Before TensorFlow is imported, the thread counts are passed through ``TF_NUM_INTRAOP_THREADS``
and ``TF_NUM_INTEROP_THREADS``, which TensorFlow reads when it creates its pools.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import re
import sys
import threading
from typing import Mapping, MutableMapping, Sequence

from tf_poseidon.world import World

MIN_INTER_OP_THREADS = 2
DEFAULT_INTER_OP_THREADS = 2
_log = logging.getLogger("tf_poseidon")


@dataclasses.dataclass(frozen=True)
class Placement:
    """What this rank uses. ``None`` means TensorFlow's own default was left in place.

    ``gpu``: the CUDA device (as numbered before selection) this rank sees, if any.
    ``notes``: why a setting was left alone or adjusted.
    """

    gpu: str | None
    intra_op_threads: int | None
    inter_op_threads: int | None
    notes: tuple[str, ...] = ()


def decide(world: World, environ: Mapping[str, str], cores: int,
           gpus: Sequence[str]) -> Placement:
    """The placement for ``world`` on a host with ``cores`` usable cores and the CUDA
    devices ``gpus`` visible to this process. Pure function; raises ValueError for a
    malformed TF_POSEIDON_*_THREADS value."""
    if world.size == 1 and world.local_size == 1:
        return Placement(None, None, None, ("single process: TensorFlow defaults kept",))
    notes = []
    if gpus:
        gpu = gpus[world.local_rank % len(gpus)]
        if len(gpus) < world.local_size:
            notes.append(f"{world.local_size} ranks on this host share {len(gpus)} GPU(s)")
        return Placement(gpu, None, None, tuple(notes))
    intra = (_env_int(environ, "TF_POSEIDON_INTRA_THREADS")
             or _slurm_cpus_per_task(environ, cores)
             or max(1, cores // world.local_size))
    inter = _env_int(environ, "TF_POSEIDON_INTER_THREADS") or DEFAULT_INTER_OP_THREADS
    if inter < MIN_INTER_OP_THREADS:
        notes.append(f"inter-op threads raised from {inter} to {MIN_INTER_OP_THREADS}: the "
                     "communication engine's ops need two")
        inter = MIN_INTER_OP_THREADS
    return Placement(None, intra, inter, tuple(notes))


def _slurm_cpus_per_task(environ: Mapping[str, str], cores: int) -> int | None:
    # Under `srun --cpus-per-task=N` the N CPUs are this task's own (bound or not).
    raw = environ.get("SLURM_CPUS_PER_TASK", "")
    return min(int(raw), cores) if raw.isdigit() and int(raw) > 0 else None


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name}={raw!r}: expected a positive integer")
    return int(raw)


def visible_gpus_before_tf(environ: Mapping[str, str]) -> list[str]:
    """CUDA devices this process would see, judged without importing TensorFlow: the
    entries of CUDA_VISIBLE_DEVICES if set (empty or -1: none), else the /dev/nvidiaN nodes."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        entries = [e.strip() for e in environ["CUDA_VISIBLE_DEVICES"].split(",") if e.strip()]
        return [] if entries[:1] == ["-1"] else entries
    nodes = [p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]
    return sorted((p[len("/dev/nvidia"):] for p in nodes), key=int)


_placement: Placement | None = None
_lock = threading.Lock()


def configure_process(world: World, environ: MutableMapping[str, str] | None = None,
                      ) -> Placement:
    """Applies :func:`decide` to this process once and returns the result; later calls
    return the first result and change nothing.

    Called by tf_poseidon at import time, on every rank; never blocks and never imports
    TensorFlow. Before TensorFlow is imported it only sets environment variables
    (CUDA_VISIBLE_DEVICES, TF_NUM_INTRAOP_THREADS, TF_NUM_INTEROP_THREADS); after, it uses
    ``tf.config`` and, if the runtime is already initialised, leaves TF as it is and says so
    in ``notes`` (logged at WARNING).
    """
    global _placement
    with _lock:
        if _placement is None:
            env = os.environ if environ is None else environ
            if "tensorflow" in sys.modules:
                _placement = _apply_with_tf(world, env)
            else:
                _placement = _apply_before_tf(world, env)
            for note in _placement.notes:
                _log.info("tf_poseidon placement (rank %d): %s", world.rank, note)
        return _placement


def _apply_before_tf(world: World, env: MutableMapping[str, str]) -> Placement:
    placement = decide(world, env, len(os.sched_getaffinity(0)), visible_gpus_before_tf(env))
    if placement.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = placement.gpu
    notes = list(placement.notes)
    intra, inter = placement.intra_op_threads, placement.inter_op_threads
    if intra is not None and inter is not None:
        intra = _set_unless_user(env, "TF_NUM_INTRAOP_THREADS", intra, notes)
        inter = _set_unless_user(env, "TF_NUM_INTEROP_THREADS", inter, notes)
        if inter < MIN_INTER_OP_THREADS:
            _log.warning("TF_NUM_INTEROP_THREADS=%d starves tf_poseidon's communication ops; "
                         "use at least %d", inter, MIN_INTER_OP_THREADS)
    return dataclasses.replace(placement, intra_op_threads=intra, inter_op_threads=inter,
                               notes=tuple(notes))


def _set_unless_user(env: MutableMapping[str, str], name: str, value: int,
                     notes: list[str]) -> int:
    user = env.get(name, "")
    if user.isdigit() and int(user) > 0:
        notes.append(f"{name}={user} set by the user is kept")
        return int(user)
    env[name] = str(value)
    return value


def _apply_with_tf(world: World, env: Mapping[str, str]) -> Placement:
    import tensorflow as tf
    physical = tf.config.list_physical_devices("GPU")
    placement = decide(world, env, len(os.sched_getaffinity(0)),
                       [str(i) for i in range(len(physical))])
    notes = list(placement.notes)
    if placement.gpu is not None:
        try:
            tf.config.set_visible_devices(physical[int(placement.gpu)], "GPU")
        except RuntimeError as e:
            notes.append(f"GPU selection skipped, TensorFlow already initialised: {e}")
            _log.warning("tf_poseidon: could not restrict rank %d to one GPU (%s); import "
                         "tf_poseidon before using TensorFlow", world.rank, e)
            placement = dataclasses.replace(placement, gpu=None)
    threading_api = tf.config.threading
    pools = (("intra", placement.intra_op_threads, "TF_NUM_INTRAOP_THREADS",
              threading_api.get_intra_op_parallelism_threads,
              threading_api.set_intra_op_parallelism_threads),
             ("inter", placement.inter_op_threads, "TF_NUM_INTEROP_THREADS",
              threading_api.get_inter_op_parallelism_threads,
              threading_api.set_inter_op_parallelism_threads))
    applied = {}
    for pool, value, env_name, get, set_ in pools:
        applied[pool] = None
        if value is None:
            continue
        if get() or env.get(env_name):
            notes.append(f"{pool}-op threads already chosen by the user: kept")
            continue
        try:
            set_(value)
            applied[pool] = value
        except RuntimeError as e:
            notes.append(f"{pool}-op threads left at TensorFlow's size, runtime already "
                         f"initialised: {e}")
            _log.warning("tf_poseidon: could not size rank %d's %s-op thread pool (%s); "
                         "import tf_poseidon before running TensorFlow ops", world.rank, pool, e)
    return dataclasses.replace(placement, intra_op_threads=applied["intra"],
                               inter_op_threads=applied["inter"], notes=tuple(notes))
