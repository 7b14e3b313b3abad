"""World detection from the variables each launcher really sets, and the per-rank placement
(GPU choice, thread pools) derived from it."""

import os
import subprocess
import sys

import pytest

from tf_poseidon import placement
from tf_poseidon.world import World, WorldError, detect_world

# As set by Open MPI 5.0.11's mpirun for rank 1 of `mpirun -np 2` (captured, trimmed).
# horovodrun in MPI mode runs this same mpirun, so its ranks see exactly these variables.
OPEN_MPI_RANK1 = {
    "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_UNIVERSE_SIZE": "2", "OMPI_VERSION": "5.0.11",
    "PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-vm-9265@1", "PRTE_LAUNCHED": "1",
}

# `srun -N 2 -n 8 --ntasks-per-node=4 --mpi=pmix`, task 5 (second node, local id 1).
SLURM_PMIX_TASK5 = {
    "PMIX_RANK": "5", "PMIX_NAMESPACE": "slurm.pmix.4242.0", "PMIX_VERSION": "4.2.9",
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "8",
    "SLURM_NPROCS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NUM_TASKS": "8", "SLURM_JOB_ID": "4242",
}

# `srun -N 2 -n 4 --mpi=pmi2`, task 3: Slurm's pmi2 plugin sets PMI_FD/JOBID/RANK/SIZE.
SLURM_PMI2_TASK3 = {
    "PMI_FD": "7", "PMI_JOBID": "4243.0", "PMI_RANK": "3", "PMI_SIZE": "4",
    "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}

# MPICH / Intel MPI Hydra `mpiexec -n 4 -ppn 2`, rank 2 (first rank of the second node).
HYDRA_RANK2 = {
    "PMI_RANK": "2", "PMI_SIZE": "4", "PMI_FD": "6", "MPI_LOCALRANKID": "0",
    "MPI_LOCALNRANKS": "2", "PMI_HOSTNAME": "server2",
}

# horovodrun's default (Gloo) mode: Horovod's own rendezvous, no MPI world.
HOROVOD_GLOO_RANK1 = {
    "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1",
    "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
    "HOROVOD_HOSTNAME": "localhost", "HOROVOD_CONTROLLER": "gloo",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "39123",
}

UNRELATED = {"HOME": "/root", "PATH": "/usr/bin", "LANG": "C.UTF-8"}


@pytest.mark.parametrize("env, expected", [
    (OPEN_MPI_RANK1, World(1, 2, 1, 2, "openmpi")),
    # Horovod tuning variables next to Open MPI's do not change anything.
    ({**OPEN_MPI_RANK1, "HOROVOD_FUSION_THRESHOLD": "67108864"}, World(1, 2, 1, 2, "openmpi")),
    (SLURM_PMIX_TASK5, World(5, 8, 1, 4, "pmix")),
    ({k: v for k, v in SLURM_PMIX_TASK5.items() if k != "SLURM_NTASKS_PER_NODE"},
     World(5, 8, 1, 4, "pmix")),
    (SLURM_PMI2_TASK3, World(3, 4, 1, 2, "pmi")),
    (HYDRA_RANK2, World(2, 4, 0, 2, "pmi")),
    (UNRELATED, World(0, 1, 0, 1, "none")),
    ({}, World(0, 1, 0, 1, "none")),
], ids=["openmpi", "horovodrun-mpi", "slurm-pmix", "slurm-pmix-no-ntasks-per-node",
        "slurm-pmi2", "mpich-hydra", "no-launcher", "empty"])
def test_detect_world(env, expected):
    assert detect_world({**UNRELATED, **env}) == expected


def test_slurm_uneven_tasks_per_node_uses_this_nodes_count():
    env = {"PMIX_RANK": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_TASKS_PER_NODE": "3,2", "SLURM_STEP_TASKS_PER_NODE": "3,2"}
    assert detect_world(env).local_size == 2


def test_horovodrun_gloo_mode_asks_for_mpi():
    with pytest.raises(WorldError, match=r"horovodrun --mpi"):
        detect_world({**UNRELATED, **HOROVOD_GLOO_RANK1})


@pytest.mark.parametrize("env, message", [
    ({"OMPI_COMM_WORLD_RANK": "one", "OMPI_COMM_WORLD_SIZE": "2"}, "not an integer"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, "outside a world of size 2"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "2"},
     "local rank 3"),
])
def test_malformed_launcher_variables(env, message):
    with pytest.raises(WorldError, match=message):
        detect_world(env)


# -- placement ---------------------------------------------------------------------------

TWO_PER_HOST = World(rank=3, size=4, local_rank=1, local_size=2, launcher="openmpi")
ALONE = World(rank=0, size=1, local_rank=0, local_size=1, launcher="none")


def test_single_process_keeps_tensorflow_defaults():
    p = placement.decide(ALONE, {}, cores=8, gpus=["0", "1"])
    assert (p.gpu, p.intra_op_threads, p.inter_op_threads) == (None, None, None)


def test_cpu_host_splits_cores_between_local_ranks():
    p = placement.decide(TWO_PER_HOST, {}, cores=16, gpus=[])
    assert (p.gpu, p.intra_op_threads, p.inter_op_threads) == (None, 8, 2)
    assert placement.decide(TWO_PER_HOST, {}, cores=1, gpus=[]).intra_op_threads == 1
    # srun --cpus-per-task=6: those 6 CPUs are this task's alone.
    slurm = {"SLURM_CPUS_PER_TASK": "6"}
    assert placement.decide(TWO_PER_HOST, slurm, cores=16, gpus=[]).intra_op_threads == 6


def test_thread_overrides_and_inter_op_floor():
    env = {"TF_POSEIDON_INTRA_THREADS": "3", "TF_POSEIDON_INTER_THREADS": "1"}
    p = placement.decide(TWO_PER_HOST, env, cores=16, gpus=[])
    assert (p.intra_op_threads, p.inter_op_threads) == (3, 2)
    assert "raised from 1 to 2" in p.notes[0]
    with pytest.raises(ValueError, match="TF_POSEIDON_INTRA_THREADS"):
        placement.decide(TWO_PER_HOST, {"TF_POSEIDON_INTRA_THREADS": "many"}, 16, [])


def test_gpu_host_gives_each_local_rank_its_gpu():
    assert placement.decide(TWO_PER_HOST, {}, 16, ["0", "1"]).gpu == "1"
    # The user's CUDA_VISIBLE_DEVICES=4,6 is honoured: local rank 1 gets device 6.
    gpus = placement.visible_gpus_before_tf({"CUDA_VISIBLE_DEVICES": "4,6"})
    assert placement.decide(TWO_PER_HOST, {}, 16, gpus).gpu == "6"
    p = placement.decide(TWO_PER_HOST, {}, 16, ["0"])
    assert p.gpu == "0" and "share 1 GPU" in p.notes[0]
    assert placement.visible_gpus_before_tf({"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_before_tensorflow_import_uses_environment_and_keeps_users_values():
    env = {}
    p = placement._apply_before_tf(TWO_PER_HOST, env)
    if p.gpu is None:  # CPU-only machine
        cores = len(os.sched_getaffinity(0))
        assert env == {"TF_NUM_INTRAOP_THREADS": str(max(1, cores // 2)),
                       "TF_NUM_INTEROP_THREADS": "2"}
    env = {"TF_NUM_INTRAOP_THREADS": "5", "CUDA_VISIBLE_DEVICES": ""}
    p = placement._apply_before_tf(TWO_PER_HOST, env)
    assert p.intra_op_threads == 5 and env["TF_NUM_INTRAOP_THREADS"] == "5"
    assert env["TF_NUM_INTEROP_THREADS"] == "2"


_BEFORE_RUNTIME_INIT = """
import os, tensorflow as tf
from tf_poseidon import placement
from tf_poseidon.world import World
world = World(rank=1, size=2, local_rank=1, local_size=2, launcher="openmpi")
placement._placement = None   # forget anything `import tf_poseidon` applied
p = placement.configure_process(world, {})
assert placement.configure_process(world, {}) is p      # idempotent
want = max(1, len(os.sched_getaffinity(0)) // 2)
assert (p.intra_op_threads, p.inter_op_threads) == (want, 2), p
assert tf.config.threading.get_intra_op_parallelism_threads() == want
assert tf.config.threading.get_inter_op_parallelism_threads() == 2
print("OK")
"""

_AFTER_RUNTIME_INIT = """
import tensorflow as tf
from tf_poseidon import placement
from tf_poseidon.world import World
tf.constant(1.0) + 1.0                                  # the runtime is now initialised
placement._placement = None
p = placement.configure_process(World(1, 2, 1, 2, "openmpi"), {})
assert (p.intra_op_threads, p.inter_op_threads) == (None, None), p
assert "runtime already initialised" in p.notes[0], p
print("OK")
"""


@pytest.mark.multirank  # starts two interpreters, each playing rank 1 of a 2-rank job
def test_after_tensorflow_import_uses_tf_config_and_tolerates_initialised_runtime():
    """In fresh interpreters (this one's TensorFlow runtime may be initialised already)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "TF_NUM_"))}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=root)
             for script in (_BEFORE_RUNTIME_INIT, _AFTER_RUNTIME_INIT)]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "OK" in stdout, stderr[-3000:]
