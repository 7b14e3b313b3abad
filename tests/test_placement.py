"""Which GPU each rank uses (tf_poseidon.placement), from faked launcher environments and device
lists: the pure functions in-process, and the real import path in a fresh interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tf_poseidon import placement
from tf_poseidon.world import World, detect_world

REPO = Path(__file__).resolve().parent.parent


def openmpi(local_rank: int, local_size: int, **extra: str) -> dict:
    """The variables Open MPI's mpirun sets for one rank of a one-host job, plus ``extra``."""
    return {"OMPI_COMM_WORLD_RANK": str(local_rank), "OMPI_COMM_WORLD_SIZE": str(local_size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size), **extra}


def srun(local_id: int, tasks: int, **extra: str) -> dict:
    """The variables `srun --mpi=pmix --ntasks=tasks` sets on a one-node step, plus ``extra``."""
    return {"PMIX_RANK": str(local_id), "SLURM_NTASKS": str(tasks),
            "SLURM_LOCALID": str(local_id), "SLURM_STEP_TASKS_PER_NODE": str(tasks),
            "SLURM_NODEID": "0", **extra}


def place(env: dict, driver_gpus: int = 0) -> placement.Placement:
    """What the rank of ``env`` does before TensorFlow's import; ``env`` is updated in place as
    os.environ would be. ``driver_gpus``: what NVML would report."""
    world = detect_world(env)
    gpus = placement.visible_gpus_before_tf(env, lambda: driver_gpus)
    return placement.decide(world, env, 16, gpus)


def test_user_visible_devices_give_ordinals_among_them():
    """CUDA_VISIBLE_DEVICES=5,7 with 2 local ranks: ordinals 0 and 1 (devices 5 and 7)."""
    chosen = [place(openmpi(r, 2, CUDA_VISIBLE_DEVICES="5,7")) for r in range(2)]
    assert [p.gpu_ordinal for p in chosen] == [0, 1]
    assert [p.gpu for p in chosen] == ["5", "7"]
    assert [p.visible_gpus for p in chosen] == [2, 2]
    assert not any(p.memory_growth for p in chosen)
    assert all(p.intra_op_threads is None for p in chosen)  # GPU hosts keep TF's pools


def test_more_ranks_than_gpus_share_them_evenly_with_memory_growth():
    chosen = [place(openmpi(r, 4), driver_gpus=2) for r in range(4)]
    assert [p.gpu_ordinal for p in chosen] == [0, 1, 0, 1]
    assert [p.gpu for p in chosen] == ["0", "1", "0", "1"]
    assert all(p.memory_growth for p in chosen)
    assert "4 ranks on this host share 2 GPU(s)" in chosen[0].notes[0]


def test_no_visible_gpu_means_cpu_threads():
    for env in (openmpi(1, 2), openmpi(1, 2, CUDA_VISIBLE_DEVICES=""),
                openmpi(1, 2, CUDA_VISIBLE_DEVICES="-1")):
        p = place(env, driver_gpus=4 if "CUDA_VISIBLE_DEVICES" in env else 0)
        assert (p.gpu, p.gpu_ordinal, p.memory_growth) == (None, None, False)
        assert (p.intra_op_threads, p.inter_op_threads) == (8, 2)


def test_unset_visible_devices_count_the_drivers_gpus_not_device_nodes():
    """In a container given host GPU 5 (/dev/nvidia5), CUDA numbers it 0: the rank must ask for
    ordinal 0, which is what the driver's count gives."""
    p = place(openmpi(1, 2), driver_gpus=1)
    assert (p.gpu, p.gpu_ordinal, p.memory_growth) == ("0", 0, True)


def test_visible_devices_are_read_as_cuda_reads_them():
    assert placement.visible_gpus_before_tf({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == ["0"]
    assert placement.visible_gpus_before_tf({"CUDA_VISIBLE_DEVICES": " 3 , 2"}) == ["3", "2"]
    uuids = "GPU-1b2c3d4e,MIG-5f6a7b8c"
    p = place(openmpi(1, 2, CUDA_VISIBLE_DEVICES=uuids))
    assert (p.gpu, p.gpu_ordinal) == ("MIG-5f6a7b8c", 1)


def test_slurm_local_id_picks_among_the_steps_gpus():
    """srun without GPU binding: every task sees the node's GPUs; SLURM_LOCALID chooses."""
    chosen = [place(srun(i, 4, CUDA_VISIBLE_DEVICES="0,1,2,3")) for i in range(4)]
    assert [p.gpu for p in chosen] == ["0", "1", "2", "3"]
    assert not any(p.memory_growth for p in chosen)


def test_slurm_gpu_binding_gives_each_task_its_own_gpu():
    """srun --gpus-per-task=1: Slurm already narrowed each task's CUDA_VISIBLE_DEVICES to its
    GPU, so every task uses its only visible device, and nobody shares."""
    chosen = [place(srun(i, 4, CUDA_VISIBLE_DEVICES=str(i), SLURM_GPUS_PER_TASK="1"))
              for i in range(4)]
    assert [(p.gpu, p.gpu_ordinal) for p in chosen] == [(str(i), 0) for i in range(4)]
    assert not any(p.memory_growth for p in chosen)
    # The same list under mpirun (inside such an allocation) does mean sharing.
    shared = place(openmpi(1, 2, CUDA_VISIBLE_DEVICES="0", SLURM_GPUS_PER_TASK="1"))
    assert shared.memory_growth


def test_single_process_keeps_every_gpu():
    p = place({"CUDA_VISIBLE_DEVICES": "5,7"})
    assert (p.gpu, p.gpu_ordinal, p.memory_growth) == (None, None, False)


def test_before_tensorflow_narrows_visible_devices_and_turns_on_growth(monkeypatch):
    monkeypatch.setattr(placement, "driver_gpu_count", lambda: 2)
    sharing = World(rank=2, size=4, local_rank=2, local_size=4, launcher="openmpi")
    env = {}
    p = placement._apply_before_tf(sharing, env)
    assert env == {"CUDA_VISIBLE_DEVICES": "0", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    assert p.describe(sharing) == ("rank 2 (local 2 of 4): GPU ordinal 0 of 2 visible "
                                   "(CUDA device '0'), memory growth on")
    env = {"CUDA_VISIBLE_DEVICES": "5,7"}
    placement._apply_before_tf(World(1, 2, 1, 2, "openmpi"), env)
    assert env == {"CUDA_VISIBLE_DEVICES": "7"}  # one GPU each: no growth needed
    env = {"CUDA_VISIBLE_DEVICES": "5", "TF_FORCE_GPU_ALLOW_GROWTH": "false"}
    p = placement._apply_before_tf(World(1, 2, 1, 2, "openmpi"), env)
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "false"
    assert any("set by the user is kept" in note for note in p.notes)


_IMPORT_AS_RANK_1_OF_2 = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
import tf_poseidon as tp
assert os.environ["CUDA_VISIBLE_DEVICES"] == "7", os.environ["CUDA_VISIBLE_DEVICES"]
assert "TF_FORCE_GPU_ALLOW_GROWTH" not in os.environ
import tensorflow as tf
assert float(tf.reduce_sum(tf.ones([3]))) == 3.0
print("devices", [d.device_type for d in tf.config.list_logical_devices()])
"""


def test_real_import_path_places_the_rank_and_tensorflow_still_runs():
    """`import tf_poseidon` as local rank 1 of 2 with CUDA_VISIBLE_DEVICES=5,7 in a fresh
    interpreter: the rank is given device 7, says so once, and TensorFlow (here without a GPU)
    still runs."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "TF_NUM_", "CUDA_"))}
    env.update(openmpi(1, 2, CUDA_VISIBLE_DEVICES="5,7", PYTHONPATH=str(REPO)))
    done = subprocess.run([sys.executable, "-c", _IMPORT_AS_RANK_1_OF_2], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    chosen = [line for line in lines if line.startswith("tf_poseidon placement: ")]
    assert chosen == ["tf_poseidon placement: rank 1 (local 1 of 2): GPU ordinal 1 of 2 "
                      "visible (CUDA device '7')"], lines
    assert "devices" in lines[-1] and "CPU" in lines[-1]


def test_driver_count_without_a_driver_is_zero():
    """This machine has no NVIDIA driver: NVML cannot be loaded, and that means no GPU."""
    if Path("/proc/driver/nvidia").exists():
        pytest.skip("an NVIDIA driver is present: its count is whatever the machine has")
    assert placement.driver_gpu_count() == 0


# -- after TensorFlow's import: tf.config, with faked device lists -----------------------------

class FakeTFConfig:
    """tf.config's device calls on a host with ``count`` GPUs, recording what placement asks;
    ``initialised``: TensorFlow's runtime already runs (the setters raise, as TF's do)."""

    def __init__(self, tf, count: int, initialised: bool = False):
        self.devices = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU")
                        for i in range(count)]
        self.initialised = initialised
        self.visible, self.growth = [], []

    def list_physical_devices(self, device_type=None):
        return list(self.devices) if device_type == "GPU" else []

    def set_visible_devices(self, devices, device_type=None):
        if self.initialised:
            raise RuntimeError("Visible devices cannot be modified after being initialized")
        self.visible.append((devices, device_type))

    def set_memory_growth(self, device, enable):
        if self.initialised:
            raise RuntimeError("Physical devices cannot be modified after being initialized")
        self.growth.append((device, enable))


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(count, initialised=False)``: tf.config in this process sees ``count`` GPUs."""
    import tensorflow as tf

    def install(count: int, initialised: bool = False) -> FakeTFConfig:
        fake = FakeTFConfig(tf, count, initialised)
        monkeypatch.setattr(tf.config, "list_physical_devices", fake.list_physical_devices)
        monkeypatch.setattr(tf.config, "set_visible_devices", fake.set_visible_devices)
        monkeypatch.setattr(tf.config.experimental, "set_memory_growth", fake.set_memory_growth)
        return fake
    return install


def test_after_tensorflow_selects_the_visible_gpu_and_names_its_cuda_entry(fake_gpus):
    """Keras imported before tf_poseidon, CUDA_VISIBLE_DEVICES=5,7, local rank 1 of 2: TF's
    GPU 1 is made the only visible one, and the choice names both ordinal 1 and device 7."""
    fake = fake_gpus(2)
    world = World(rank=1, size=2, local_rank=1, local_size=2, launcher="openmpi")
    p = placement._apply_with_tf(world, {"CUDA_VISIBLE_DEVICES": "5,7"})
    assert fake.visible == [(fake.devices[1], "GPU")] and fake.growth == []
    assert (p.gpu, p.gpu_ordinal, p.visible_gpus, p.memory_growth) == ("7", 1, 2, False)
    assert (p.intra_op_threads, p.inter_op_threads) == (None, None)
    assert p.describe(world) == ("rank 1 (local 1 of 2): GPU ordinal 1 of 2 visible "
                                 "(CUDA device '7')")


def test_after_tensorflow_ranks_sharing_a_gpu_get_memory_growth(fake_gpus):
    fake = fake_gpus(2)
    world = World(rank=3, size=4, local_rank=3, local_size=4, launcher="openmpi")
    p = placement._apply_with_tf(world, {})
    assert fake.visible == [(fake.devices[1], "GPU")]
    assert fake.growth == [(fake.devices[1], True)]
    assert (p.gpu, p.gpu_ordinal, p.memory_growth) == ("1", 1, True)
    fake = fake_gpus(2)  # the user's TF_FORCE_GPU_ALLOW_GROWTH decides instead
    p = placement._apply_with_tf(world, {"TF_FORCE_GPU_ALLOW_GROWTH": "false"})
    assert fake.growth == [] and p.memory_growth


def test_after_tensorflow_a_device_list_unlike_the_variable_is_named_by_tensorflow(fake_gpus):
    """TensorFlow lists 2 GPUs where CUDA_VISIBLE_DEVICES has 3 entries (it left one out):
    which entry is which cannot be told, so the choice is named by TensorFlow's device."""
    fake_gpus(2)
    world = World(rank=1, size=2, local_rank=1, local_size=2, launcher="openmpi")
    p = placement._apply_with_tf(world, {"CUDA_VISIBLE_DEVICES": "5,7,9"})
    assert (p.gpu, p.gpu_ordinal) == ("/physical_device:GPU:1", 1)


def test_after_tensorflow_runs_the_gpus_stay_and_the_rank_says_why(fake_gpus, caplog):
    fake_gpus(2, initialised=True)
    world = World(rank=1, size=2, local_rank=1, local_size=2, launcher="openmpi")
    with caplog.at_level("WARNING", logger="tf_poseidon"):
        p = placement._apply_with_tf(world, {})
    assert (p.gpu, p.gpu_ordinal) == (None, None)
    assert any("GPU selection skipped" in note for note in p.notes)
    assert "could not restrict rank 1 to one GPU" in caplog.text


# -- who tells the user: rank 0 once, the others only when asked --------------------------------

def _import_as(rank: int, **extra: str) -> subprocess.CompletedProcess:
    """``import tf_poseidon`` (which does not import TensorFlow) in a fresh interpreter as rank
    ``rank`` of a 2-rank job on one host with CUDA_VISIBLE_DEVICES=5,7, logging unconfigured."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "TF_NUM_", "CUDA_",
                                "TF_POSEIDON_"))}
    env.update(openmpi(rank, 2, CUDA_VISIBLE_DEVICES="5,7", PYTHONPATH=str(REPO), **extra))
    return subprocess.run([sys.executable, "-c", "import tf_poseidon"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_rank_0_prints_its_placement_once_and_the_other_ranks_stay_quiet():
    chief, other = _import_as(0), _import_as(1)
    assert chief.returncode == other.returncode == 0, chief.stderr + other.stderr
    assert chief.stderr.splitlines() == ["tf_poseidon placement: rank 0 (local 0 of 2): GPU "
                                         "ordinal 0 of 2 visible (CUDA device '5')"]
    assert (chief.stdout, other.stdout, other.stderr) == ("", "", "")
    every = _import_as(1, TF_POSEIDON_LOG_ALL_RANKS="1")
    assert every.stderr.splitlines() == ["tf_poseidon placement: rank 1 (local 1 of 2): GPU "
                                         "ordinal 1 of 2 visible (CUDA device '7')"]


def test_where_logging_shows_the_placement_it_is_not_printed_again(capsys, caplog):
    world = World(rank=0, size=2, local_rank=0, local_size=2, launcher="openmpi")
    with caplog.at_level("INFO", logger="tf_poseidon"):  # a handler that shows INFO records
        placement._announce("tf_poseidon placement: here", world, {})
    assert caplog.messages == ["tf_poseidon placement: here"]
    assert capsys.readouterr().err == ""
