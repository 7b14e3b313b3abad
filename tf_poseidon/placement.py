"""One process per device: which GPU a rank uses, and how many CPU threads TensorFlow may use.

Rules (applied only when the job has more than one process, on this host or in all; a plain
``python train.py`` keeps TensorFlow's defaults):

- **GPU hosts**: the rank uses the visible GPU whose position among the visible ones is its
  local rank (modulo their number, so that 4 ranks on 2 GPUs put 2 on each). "Visible" is what
  CUDA would show this process: the entries of ``CUDA_VISIBLE_DEVICES`` when it is set (by the
  user, docker/Kubernetes, or Slurm's GPU binding: under ``srun --gpus-per-task`` each task's
  list holds its own GPUs), else every GPU the NVIDIA driver reports (counted through NVML,
  which does not initialise CUDA). The local rank is the launcher's (Open MPI's
  ``OMPI_COMM_WORLD_LOCAL_RANK``, Slurm's ``SLURM_LOCALID``, Hydra's ``MPI_LOCALRANKID``; see
  world.py). Device-node numbers (``/dev/nvidiaN``) are never used as CUDA ordinals: in a
  container given GPU 5 the node is ``/dev/nvidia5`` but CUDA calls the device 0.
  Before TensorFlow is imported the choice is made with ``CUDA_VISIBLE_DEVICES`` (narrowed to
  the chosen entry); after, with ``tf.config.set_visible_devices``.
  When local ranks outnumber the visible GPUs (so ranks may share one), memory growth is turned
  on (``TF_FORCE_GPU_ALLOW_GROWTH=true`` before TensorFlow's import, unless the user set it;
  ``tf.config.experimental.set_memory_growth`` after); otherwise the first rank on a GPU would
  take all its memory. Thread pools keep TF's defaults.
- **CPU-only hosts**: the cores this process may run on (``os.sched_getaffinity``) are shared
  by the ranks of the host: intra-op threads = max(1, cores // local_size); inter-op threads =
  2. Under ``srun --cpus-per-task=N`` the N CPUs are the task's own: intra-op threads = N.
  ``TF_POSEIDON_INTRA_THREADS`` / ``TF_POSEIDON_INTER_THREADS`` override the two numbers.
  The division assumes the ranks are not bound to cores by the launcher (``tfposeidon-run``
  passes ``--bind-to none``; plain ``mpirun`` binds by default — pass ``--bind-to none``).
  The inter-op pool is never made smaller than 2: the communication engine's graph ops run on
  it and a single inter-op thread starves them.
- **The user's own settings win**: ``TF_NUM_INTRAOP_THREADS``/``TF_NUM_INTEROP_THREADS`` and
  ``TF_FORCE_GPU_ALLOW_GROWTH`` in the environment, and ``tf.config.threading.set_*`` calls
  (made before or after this).
- If TensorFlow's runtime is already initialised, the pools (and visible GPUs) can no longer
  change; that is reported in :attr:`Placement.notes` and logged, not raised.

The choice is logged once per process (logger ``tf_poseidon``, INFO). So that a user sees it
without configuring logging, rank 0 also prints that line to stderr once where logging would
not show it (the default: nothing shows tf_poseidon's INFO records); the other ranks stay
quiet unless ``TF_POSEIDON_LOG_ALL_RANKS=1``, under which each prints its own. Before
TensorFlow is imported, the thread counts are passed through ``TF_NUM_INTRAOP_THREADS`` and
``TF_NUM_INTEROP_THREADS``, which TensorFlow reads when it creates its pools.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import sys
import threading
from typing import Callable, Mapping, MutableMapping, Sequence

from tf_poseidon.world import World

MIN_INTER_OP_THREADS = 2
DEFAULT_INTER_OP_THREADS = 2
ALLOW_GROWTH_ENV = "TF_FORCE_GPU_ALLOW_GROWTH"
LOG_ALL_RANKS_ENV = "TF_POSEIDON_LOG_ALL_RANKS"
_log = logging.getLogger("tf_poseidon")


@dataclasses.dataclass(frozen=True)
class Placement:
    """What this rank uses. ``None`` means TensorFlow's own default was left in place.

    ``gpu``: the device this rank uses, named as the process saw the devices before the choice
    (an entry of ``CUDA_VISIBLE_DEVICES``: an index, a ``GPU-…`` UUID or a ``MIG-…`` id; or,
    when TensorFlow was imported first and lists another number of GPUs than that variable
    has entries, TensorFlow's name of the device, ``/physical_device:GPU:<n>``).
    ``gpu_ordinal``: its position among the visible devices before the choice (TensorFlow's
    ``/GPU:<gpu_ordinal>`` then; after the choice the rank sees it as ``/GPU:0``).
    ``visible_gpus``: how many devices were visible before the choice.
    ``memory_growth``: whether memory growth was asked for (local ranks outnumber the GPUs).
    ``notes``: why a setting was left alone or adjusted.
    """

    gpu: str | None
    intra_op_threads: int | None
    inter_op_threads: int | None
    notes: tuple[str, ...] = ()
    gpu_ordinal: int | None = None
    visible_gpus: int = 0
    memory_growth: bool = False

    def describe(self, world: World) -> str:
        """One line saying what rank ``world.rank`` uses (logged once per process)."""
        where = f"rank {world.rank} (local {world.local_rank} of {world.local_size})"
        if self.gpu is not None:
            growth = ", memory growth on" if self.memory_growth else ""
            return (f"{where}: GPU ordinal {self.gpu_ordinal} of {self.visible_gpus} visible "
                    f"(CUDA device {self.gpu!r}){growth}")
        if self.intra_op_threads is None and self.inter_op_threads is None:
            return f"{where}: TensorFlow's default devices and thread pools"
        return (f"{where}: CPU, {self.intra_op_threads} intra-op / {self.inter_op_threads} "
                f"inter-op threads")


def _single_process(world: World) -> bool:
    return world.size == 1 and world.local_size == 1


def decide(world: World, environ: Mapping[str, str], cores: int,
           gpus: Sequence[str]) -> Placement:
    """The placement for ``world`` on a host with ``cores`` usable cores and the CUDA
    devices ``gpus`` visible to this process, in CUDA's order (entries of
    ``CUDA_VISIBLE_DEVICES``, or ``"0"``, ``"1"``, ... when it is unset). Pure function; raises
    ValueError for a malformed TF_POSEIDON_*_THREADS value."""
    if _single_process(world):
        return Placement(None, None, None, ("single process: TensorFlow defaults kept",))
    notes = []
    if gpus:
        ordinal = world.local_rank % len(gpus)
        sharing = world.local_size > len(gpus) and not _gpus_bound_per_task(world, environ)
        if sharing:
            notes.append(f"{world.local_size} ranks on this host share {len(gpus)} GPU(s): "
                         "memory growth on")
        return Placement(gpus[ordinal], None, None, tuple(notes), gpu_ordinal=ordinal,
                         visible_gpus=len(gpus), memory_growth=sharing)
    intra = (_env_int(environ, "TF_POSEIDON_INTRA_THREADS")
             or _slurm_cpus_per_task(environ, cores)
             or max(1, cores // world.local_size))
    inter = _env_int(environ, "TF_POSEIDON_INTER_THREADS") or DEFAULT_INTER_OP_THREADS
    if inter < MIN_INTER_OP_THREADS:
        notes.append(f"inter-op threads raised from {inter} to {MIN_INTER_OP_THREADS}: the "
                     "communication engine's ops need two")
        inter = MIN_INTER_OP_THREADS
    return Placement(None, intra, inter, tuple(notes))


def _gpus_bound_per_task(world: World, environ: Mapping[str, str]) -> bool:
    # srun --gpus-per-task gives each task a CUDA_VISIBLE_DEVICES of its own GPUs, so fewer
    # visible GPUs than local ranks does not mean that ranks share one. (Under mpirun inside
    # such an allocation every rank sees the same list: launcher "openmpi", not this case.)
    return world.launcher in ("pmix", "pmi") and bool(environ.get("SLURM_GPUS_PER_TASK"))


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


def driver_gpu_count() -> int:
    """Number of GPUs the NVIDIA driver reports to this process (NVML), without initialising
    CUDA; 0 when there is no driver. Inside a container it counts the container's GPUs."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    count = ctypes.c_uint(0)
    try:
        if nvml.nvmlInit_v2() != 0:
            return 0
        try:
            return count.value if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else 0
        finally:
            nvml.nvmlShutdown()
    except AttributeError:  # a driver library without these entry points
        return 0


def visible_gpus_before_tf(environ: Mapping[str, str],
                           gpu_count: Callable[[], int] | None = None) -> list[str]:
    """CUDA devices this process would see, judged without importing TensorFlow or initialising
    CUDA, in CUDA's order: the entries of ``CUDA_VISIBLE_DEVICES`` if it is set (as CUDA reads
    it, an entry such as ``-1`` hides itself and every entry after it), else ``"0"`` ...
    ``str(n - 1)`` for the ``n = gpu_count()`` GPUs of the driver (default
    :func:`driver_gpu_count`)."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        visible = []
        for entry in environ["CUDA_VISIBLE_DEVICES"].split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            visible.append(entry)
        return visible
    return [str(i) for i in range((gpu_count or driver_gpu_count)())]


_placement: Placement | None = None
_lock = threading.Lock()


def configure_process(world: World, environ: MutableMapping[str, str] | None = None,
                      ) -> Placement:
    """Applies :func:`decide` to this process once and returns the result; later calls
    return the first result and change nothing.

    Called by tf_poseidon at import time, on every rank; never blocks and never imports
    TensorFlow. Before TensorFlow is imported it only sets environment variables
    (CUDA_VISIBLE_DEVICES, TF_FORCE_GPU_ALLOW_GROWTH, TF_NUM_INTRAOP_THREADS,
    TF_NUM_INTEROP_THREADS); after, it uses ``tf.config`` and, if the runtime is already
    initialised, leaves TF as it is and says so in ``notes`` (logged at WARNING). Logs the
    choice once (INFO; see :func:`_announce` for who also prints it).
    """
    global _placement
    with _lock:
        if _placement is None:
            env = os.environ if environ is None else environ
            if "tensorflow" in sys.modules:
                _placement = _apply_with_tf(world, env)
            else:
                _placement = _apply_before_tf(world, env)
            if not _single_process(world):
                _announce(f"tf_poseidon placement: {_placement.describe(world)}", world, env)
            for note in _placement.notes:
                _log.info("tf_poseidon placement (rank %d): %s", world.rank, note)
        return _placement


def _announce(line: str, world: World, environ: Mapping[str, str]) -> None:
    """Logs ``line`` (logger ``tf_poseidon``, INFO) and, where logging would not show that
    record (no handler, or tf_poseidon's INFO records filtered out: Python's default), also
    prints it to stderr on rank 0, or on every rank under ``TF_POSEIDON_LOG_ALL_RANKS=1``."""
    _log.info("%s", line)
    if _log.isEnabledFor(logging.INFO) and _log.hasHandlers():
        return
    if world.rank == 0 or environ.get(LOG_ALL_RANKS_ENV) == "1":
        print(line, file=sys.stderr, flush=True)


def _apply_before_tf(world: World, env: MutableMapping[str, str]) -> Placement:
    gpus = [] if _single_process(world) else visible_gpus_before_tf(env)
    placement = decide(world, env, len(os.sched_getaffinity(0)), gpus)
    notes = list(placement.notes)
    if placement.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = placement.gpu
        if placement.memory_growth and env.get(ALLOW_GROWTH_ENV):
            notes.append(f"{ALLOW_GROWTH_ENV}={env[ALLOW_GROWTH_ENV]} set by the user is kept")
        elif placement.memory_growth:
            env[ALLOW_GROWTH_ENV] = "true"
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


def _gpu_names(physical: Sequence, environ: Mapping[str, str]) -> list[str]:
    """Names of TensorFlow's physical GPUs ``physical``, in its order: the entries of
    ``CUDA_VISIBLE_DEVICES`` (as :func:`visible_gpus_before_tf` reads them, ``"0"``, ``"1"``,
    ... when it is unset), or TensorFlow's own device names when the two lists differ in
    length (TensorFlow leaves out GPUs it cannot use, and then which entry is which is
    unknown)."""
    names = visible_gpus_before_tf(environ, lambda: len(physical))
    return names if len(names) == len(physical) else [device.name for device in physical]


def _apply_with_tf(world: World, env: Mapping[str, str]) -> Placement:
    import tensorflow as tf
    physical = [] if _single_process(world) else tf.config.list_physical_devices("GPU")
    placement = decide(world, env, len(os.sched_getaffinity(0)), _gpu_names(physical, env))
    notes = list(placement.notes)
    if placement.gpu is not None:
        device = physical[placement.gpu_ordinal]
        try:
            tf.config.set_visible_devices(device, "GPU")
        except RuntimeError as e:
            notes.append(f"GPU selection skipped, TensorFlow already initialised: {e}")
            _log.warning("tf_poseidon: could not restrict rank %d to one GPU (%s); import "
                         "tf_poseidon before using TensorFlow", world.rank, e)
            placement = dataclasses.replace(placement, gpu=None, gpu_ordinal=None)
        if placement.memory_growth and not env.get(ALLOW_GROWTH_ENV):
            try:
                tf.config.experimental.set_memory_growth(device, True)
            except (RuntimeError, ValueError) as e:  # runtime up, or virtual devices set
                notes.append(f"memory growth not set: {e}")
                _log.warning("tf_poseidon: rank %d shares its GPU but memory growth could not "
                             "be set (%s); set %s=true", world.rank, e, ALLOW_GROWTH_ENV)
                placement = dataclasses.replace(placement, memory_growth=False)
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
