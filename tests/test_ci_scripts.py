"""The ci/ scripts' own logic, cheaply and without a GPU: ci/demo.sh's and ci/test.sh's compiler
check before pip and demo.sh's skipped reinstall (ci/venv_install.sh, on a small copy of the
tree with stand-ins for python3 and the installed launcher); ci/check_gpu.sh's outcomes where
it cannot run (no GPU, no nvcc, no time left: stand-ins for nvidia-smi), its nvcc -> CUDA_HOME
and its pinned venv; ci/gpu_bench.py's CPU form in this process; ci/gpu_train.py on 2 ranks
of the CPU (multirank)."""

import configparser
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from multirank import run_job

REPO = Path(__file__).resolve().parent.parent
BASH = shutil.which("bash")
NO_COMPILER = ("tf_poseidon needs a C++17 compiler to build its ops: g++ is not found on PATH; "
               "install it (Debian/Ubuntu: apt install g++; Fedora/RHEL: dnf install gcc-c++) "
               "or set CXX to another C++17 compiler")


def executable(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def tools(directory: Path, *names: str) -> Path:
    """``directory`` holding links to this machine's ``names`` commands: a PATH with exactly
    those (and so no compiler)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).symlink_to(shutil.which(name))
    return directory


# -- ci/demo.sh and ci/test.sh: before pip (ci/venv_install.sh) ---------------------------------

DIGEST_TOOLS = ("dirname", "cat", "find", "sort", "xargs", "sha256sum", "cut", "rm")


@pytest.fixture
def tree(tmp_path) -> Path:
    """A small checkout: the install scripts and stand-ins for the files they digest, with a
    python3 on PATH that only notes that it was called (as the venv/pip step would be)."""
    root = tmp_path / "checkout"
    for script in ("demo.sh", "test.sh", "venv_install.sh"):
        (root / "ci").mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "ci" / script, root / "ci" / script)
    for name, text in [("setup.py", "setup()\n"), ("setup.cfg", "[metadata]\n"),
                       ("pyproject.toml", "[build-system]\n"), ("kernels/ops.cc", "int x;\n"),
                       ("tf_poseidon/__init__.py", "")]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    tools(root / "bin", *DIGEST_TOOLS)
    executable(root / "bin" / "python3", f'echo "$*" >> {root}/python3-called; exit 1\n')
    return root


def run_script(root: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, str(root / "ci" / script), *args], capture_output=True,
                          text=True, timeout=60, env={"PATH": str(root / "bin"), **env})


@pytest.mark.parametrize("script", ["demo.sh", "test.sh"])
def test_without_a_compiler_the_script_stops_before_pip_with_one_line(tree, script):
    done = run_script(tree, script)
    assert done.returncode != 0
    assert done.stderr.splitlines() == [NO_COMPILER] and done.stdout == ""
    assert not (tree / "python3-called").exists()  # neither venv nor pip was started
    done = run_script(tree, script, CXX="clang++-missing")
    assert done.stderr.splitlines() == [
        "tf_poseidon needs a C++17 compiler to build its ops: CXX=clang++-missing is not "
        "found on PATH; set CXX to an installed compiler (e.g. CXX=g++)"]


@pytest.mark.parametrize("script", ["demo.sh", "test.sh"])
def test_with_a_compiler_the_script_goes_on_to_make_the_venv(tree, script):
    executable(tree / "bin" / "g++", "exit 0\n")
    done = run_script(tree, script)
    assert done.returncode != 0  # the python3 stand-in fails
    assert (tree / "python3-called").read_text() == "-m venv .venv\n", done.stderr


def digest(root: Path, extras: str = ".[cpu]") -> str:
    done = subprocess.run([BASH, "-c", f'source ci/venv_install.sh && source_digest "{extras}"'],
                          cwd=root, capture_output=True, text=True, timeout=60, check=True)
    assert done.stderr == ""
    return done.stdout.strip()


def test_source_digest_follows_the_sources_and_extras_only(tree):
    first = digest(tree)
    assert re.fullmatch(r"[0-9a-f]{64}", first) and digest(tree) == first
    assert digest(tree, ".[test]") != first
    (tree / "tf_poseidon" / "__pycache__").mkdir()
    (tree / "tf_poseidon" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (tree / "tf_poseidon" / "_poseidon_ops.so").write_bytes(b"\0")
    (tree / "build").mkdir()
    (tree / "build" / "anything").write_text("x")
    assert digest(tree) == first  # compiled files and build output do not count
    (tree / "kernels" / "ops.cc").write_text("int y;\n")
    assert digest(tree) != first
    assert re.fullmatch(r"[0-9a-f]{64}", digest(REPO))  # and the real tree's files digest


def test_demo_rerun_skips_the_install_when_nothing_changed(tree):
    """A venv with the launcher and a stamp of the current sources: demo.sh starts the job
    at once, with neither compiler nor python3 (venv, pip) involved."""
    executable(tree / ".venv" / "bin" / "tfposeidon-run", 'echo "launched: $*"\n')
    (tree / ".venv" / ".demo-installed").write_text(digest(tree) + "\n")
    done = run_script(tree, "demo.sh", "--epochs", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "launched: -np 2 python examples/train_digits.py --epochs 1\n"
    assert done.stderr == ("ci/demo.sh: .venv has tf_poseidon from the current sources; "
                           "not reinstalling\n")
    assert not (tree / "python3-called").exists()
    (tree / "tf_poseidon" / "__init__.py").write_text("changed = True\n")
    executable(tree / "bin" / "g++", "exit 0\n")
    done = run_script(tree, "demo.sh")
    assert done.returncode != 0  # the python3 stand-in fails
    assert (tree / "python3-called").read_text() == "-m venv .venv\n"  # reinstalling


# -- ci/check_gpu.sh where it cannot run everything ----------------------------------------------

GPU_CHECKS = ["CUDA kernels vs CPU loops (harness)", "ops built for the GPU, pack runs there",
              "fuzzed kernel tests and op tests on the GPU",
              "speed goals in TensorFlow on the GPU", "digits on 2 ranks: GPU vs CPU"]
REAL_NVCC = os.environ.get("NVCC") or shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)


def check_gpu(tmp_path: Path, nvidia_smi: str, *args: str, **env: str):
    """Runs ci/check_gpu.sh with an nvidia-smi stand-in (shell ``nvidia_smi``) first on PATH;
    returns (the finished process, the results table's rows as (check, result, detail))."""
    stubs = tmp_path / "stubs"
    executable(stubs / "nvidia-smi", nvidia_smi)
    results = tmp_path / "results.md"
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", **env}
    done = subprocess.run([BASH, str(REPO / "ci" / "check_gpu.sh"), *args, str(results)],
                          capture_output=True, text=True, timeout=120, env=env)
    rows = [tuple(cell.strip() for cell in line.split("|")[1:4])
            for line in results.read_text().splitlines() if line.startswith("| ")][1:]
    return done, rows


NO_GPU = 'echo "No devices were found"; exit 6\n'
FAKE_GPU = ('case "$*" in *compute_cap*) echo 9.0 ;; '
            '*) echo "NVIDIA Fake GPU, 580.00, 81559 MiB" ;; esac\n')


def test_check_gpu_without_a_gpu_exits_2_and_runs_nothing(tmp_path):
    done, rows = check_gpu(tmp_path, NO_GPU)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "ci/check_gpu.sh: no NVIDIA GPU (nvidia-smi lists none); nothing was run" in done.stderr
    assert rows == [(name, "NOT RUN", "no NVIDIA GPU: nvidia-smi lists none")
                    for name in GPU_CHECKS]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.md", "stubs"]  # no logs


def test_check_gpu_without_nvcc_exits_2_with_the_reason(tmp_path):
    done, rows = check_gpu(tmp_path, FAKE_GPU, NVCC=str(tmp_path / "no-nvcc"))
    assert done.returncode == 2, done.stdout + done.stderr
    reason = f"no nvcc: NVCC={tmp_path / 'no-nvcc'} does not run as a CUDA toolkit's nvcc; set NVCC"
    assert rows == [(name, "NOT RUN", reason) for name in GPU_CHECKS]


@pytest.mark.skipif(REAL_NVCC is None, reason="no nvcc on this machine")
def test_check_gpu_takes_cuda_home_from_nvcc_and_starts_nothing_past_its_budget(tmp_path):
    """NVCC a wrapper script outside the toolkit (as /usr/local/bin/nvcc often is): CUDA_HOME
    is the toolkit nvcc itself names, where kernels/build.py finds bin/nvcc and the headers.
    With a 20 s budget no step can be given the 10 s it needs: all NOT RUN, exit 2. Without
    PYTHON it would create build/gpu_venv with setup.cfg's pins."""
    wrapper = executable(tmp_path / "wrapper" / "nvcc", f'exec {REAL_NVCC} "$@"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "CUDA_HOME")}
    env.update(NVCC=str(wrapper), GPU_CHECK_BUDGET_S="20")
    stubs = tmp_path / "stubs"
    executable(stubs / "nvidia-smi", FAKE_GPU)
    # build/gpu_venv of a real run must not satisfy this one: a checkout of its own.
    checkout = tmp_path / "checkout"
    (checkout / "ci").mkdir(parents=True)
    shutil.copy(REPO / "ci" / "check_gpu.sh", checkout / "ci")
    shutil.copy(REPO / "setup.cfg", checkout)
    env["PATH"] = f"{stubs}:{env['PATH']}"
    results = tmp_path / "results.md"
    done = subprocess.run([BASH, str(checkout / "ci" / "check_gpu.sh"), str(results)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    text = results.read_text()
    cuda_home = Path(re.search(r"\(CUDA_HOME=(\S+)\)", text).group(1))
    assert (cuda_home / "bin" / "nvcc").is_file() and (cuda_home / "include").is_dir()
    assert cuda_home != wrapper.parent.parent
    assert "GPU: NVIDIA Fake GPU, 580.00, 81559 MiB." in text
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    pins = cfg["options"]["install_requires"].split() + cfg["options.extras_require"]["gpu"].split()
    [installing] = [line for line in done.stdout.splitlines() if "creating build/gpu_venv" in line]
    assert set(pins) <= set(installing.split(": pip install ")[1].split()), installing
    assert not (checkout / "build" / "gpu_venv").exists()
    assert "| CUDA kernels vs CPU loops (harness) | NOT RUN | time budget (20 s) spent |" in text
    assert ("| ops built for the GPU, pack runs there | NOT RUN | no PYTHON given, and "
            "build/gpu_venv could not be created (time budget (20 s) spent)") in text


def test_check_gpu_dry_run_on_the_cpu_reports_what_the_cpu_cannot_do(tmp_path):
    done, rows = check_gpu(tmp_path, NO_GPU, "--cpu", GPU_CHECK_BUDGET_S="20",
                           PYTHON=sys.executable)
    assert done.returncode == 2, done.stdout + done.stderr
    assert rows == [
        ("CUDA kernels vs CPU loops (harness)", "NOT RUN", "CPU dry run: the harness needs a GPU"),
        *[(name, "NOT RUN", "time budget (20 s) spent") for name in [
            "ops built for the CPU, pack runs there", "fuzzed kernel tests and op tests on the CPU",
            "speed goals in TensorFlow on the CPU", "digits on 2 ranks: CPU vs CPU"]]]


# -- ci/gpu_bench.py and ci/gpu_train.py on the CPU ---------------------------------------------

def test_gpu_bench_runs_on_the_cpu_and_prints_its_table(capsys):
    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "ci" / "gpu_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    status = bench.main(["--device", "CPU", "--elements", "100003", "--sfb-shape", "8,64,32"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| tf | ")]
    goals = [line for line in lines if line.startswith(("PASS ", "FAIL "))]
    assert [row.split(" | ")[1] for row in rows] == [
        "memcpy (TF DeepCopy), 0.0004 GB f32",
        *[f"{kind} {op} f32 <-> f16, 0.0004 GB f32 in 50 tensors"
          for op in ("pack", "unpack") for kind in ("compiled", "composite")],
        "pack+unpack: composite time / compiled time",
        *[f"sfb_reconstruct {label}, R=8 M=64 N=32: {which}"
          for label in ("f32, tf32", "f32, exact", "f16 factors")
          for which in ("compiled", "TF matmul")]]
    assert all(re.fullmatch(r"\| tf \| .+ \| \d+\.\d{3} \| \S.* \| .* \|", row) for row in rows)
    assert len(goals) == 6  # two memcpy shares, the speed-up, three GEMMs
    met = sum(goal.startswith("PASS") for goal in goals)
    assert lines[-1] == f"goals: {met} met, {6 - met} missed"
    assert status == (0 if met == 6 else 1)


@pytest.mark.multirank
def test_gpu_train_expecting_the_cpu_trains_and_reports_each_rank():
    result, _ = run_job(2, str(REPO / "ci" / "gpu_train.py"), "--expect", "cpu", "--epochs", "1",
                        "--verbose", "0", env={"CUDA_VISIBLE_DEVICES": "-1"})
    assert result.returncode == 0, result.stdout[-4000:]
    ranks = sorted(re.findall(r"^rank (\d): rank \1 \(local \1 of 2\): CPU, .*; ops on "
                              r"\S+CPU:0; buckets packed on the GPU: no; accuracy (\S+)$",
                              result.stdout, re.M))
    assert [rank for rank, _ in ranks] == ["0", "1"], result.stdout[-4000:]
    assert re.search(r"^test accuracy: \d\.\d{4} \(2 rank\(s\)", result.stdout, re.M)
    assert "FAIL" not in result.stdout


@pytest.mark.multirank
def test_gpu_train_expecting_a_gpu_fails_on_the_cpu_naming_each_missing_part():
    """What a run that fell back to the CPU or the host form looks like to ci/check_gpu.sh."""
    result, _ = run_job(2, str(REPO / "ci" / "gpu_train.py"), "--expect", "gpu", "--epochs", "1",
                        "--verbose", "0", env={"CUDA_VISIBLE_DEVICES": "-1"})
    assert result.returncode != 0
    for rank in "01":
        assert f"rank {rank}: FAIL expected one GPU and ops on it, got []" in result.stdout
        assert (f"rank {rank}: FAIL pack under /GPU:0 ran on /job:localhost/replica:0/task:0/"
                "device:CPU:0: no GPU kernel in the ops") in result.stdout
        assert (f"rank {rank}: FAIL the all-reduce buckets were not packed on the GPU (no 'all-"
                "reduce buckets are packed on the GPU' logged): the host form ran") in result.stdout
