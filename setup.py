"""Packaging with a compile step: kernels/ -> tf_poseidon/_poseidon_ops.so.

Metadata lives in setup.cfg. The op library is compiled by kernels/build.py against the TensorFlow
importable in the build environment (pyproject.toml pins it for isolated builds; with
``pip install --no-build-isolation`` it is the user's own TensorFlow). The kernel sources are also
installed as tf_poseidon/_kernels, so that tf_poseidon/ops.py can rebuild the library on first use
when the TensorFlow it runs with differs from the one it was built against (docs/kernels.md).
"""

import importlib.util
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.errors import CompileError

KERNELS = Path("kernels")
KERNEL_FILES = sorted(p for p in KERNELS.iterdir() if p.suffix in {".cc", ".h", ".cu", ".py"})


def _build_recipe():
    spec = importlib.util.spec_from_file_location("tf_poseidon_kernel_build", KERNELS / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiler_or_error() -> None:
    """Fails the build at once, with kernels/build.py's one-line message, when no C++ compiler is
    found. setuptools prints a CompileError as one ``error: ...`` line, the last of the output."""
    recipe = _build_recipe()
    try:
        recipe.compiler()
    except recipe.BuildError as error:
        raise CompileError(str(error)) from None


class BuildCheckingCompiler(build):
    """``build`` that looks for the compiler first, before the many lines of copying files."""

    def run(self) -> None:
        _compiler_or_error()
        super().run()


class BuildOps(build_ext):
    """Builds the op library with kernels/build.py instead of distutils' compiler."""

    def get_ext_filename(self, fullname: str) -> str:
        return str(Path(*fullname.split("."))) + ".so"

    def build_extension(self, ext: Extension) -> None:
        recipe = _build_recipe()
        try:
            recipe.build(Path(self.get_ext_fullpath(ext.name)))
        except recipe.BuildError as error:
            raise CompileError(str(error)) from None


class BuildPyWithKernels(build_py):
    """Also installs the kernel sources and their build recipe as tf_poseidon/_kernels."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "tf_poseidon" / "_kernels"
        target.mkdir(parents=True, exist_ok=True)
        for source in KERNEL_FILES:
            shutil.copy2(source, target / source.name)


setup(
    ext_modules=[
        Extension(
            "tf_poseidon._poseidon_ops",
            sources=[str(p) for p in KERNEL_FILES if p.suffix == ".cc"],
            depends=[str(p) for p in KERNEL_FILES if p.suffix != ".cc"],
        )
    ],
    cmdclass={"build": BuildCheckingCompiler, "build_ext": BuildOps,
              "build_py": BuildPyWithKernels},
)
