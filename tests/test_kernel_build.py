"""Building the ops without a C++ compiler fails at once with one line naming the missing
compiler and how to get one, and that line ends the output of ``setup.py`` (so of pip)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _recipe():
    spec = importlib.util.spec_from_file_location("kernel_build_recipe",
                                                  REPO / "kernels" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_build_without_gxx_on_path_names_it_and_how_to_install_it(tmp_path, monkeypatch):
    recipe = _recipe()
    monkeypatch.setenv("PATH", str(tmp_path))  # a real PATH, with no compiler in it
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(recipe.BuildError) as raised:
        recipe.build(tmp_path / "lib.so")
    message = str(raised.value)
    assert "\n" not in message
    assert "g++ is not found on PATH" in message
    assert "apt install g++" in message and "set CXX" in message
    assert not (tmp_path / "lib.so").exists()


def test_build_with_cxx_naming_a_missing_compiler_names_cxx(tmp_path, monkeypatch):
    recipe = _recipe()
    monkeypatch.setenv("CXX", "clang++-missing")
    with pytest.raises(recipe.BuildError, match=r"CXX=clang\+\+-missing is not found on PATH; "
                                                r"set CXX to an installed compiler"):
        recipe.build(tmp_path / "lib.so")


def test_setup_py_build_without_a_compiler_ends_with_that_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env["PATH"] = str(tmp_path)
    done = subprocess.run([sys.executable, "setup.py", "build", "--build-base",
                           str(tmp_path / "build")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    expected = ("error: tf_poseidon needs a C++17 compiler to build its ops: g++ is not found on "
                "PATH; install it (Debian/Ubuntu: apt install g++")
    assert last.startswith(expected), done.stderr[-3000:]
    assert "copying" not in done.stdout  # failed before copying the package
