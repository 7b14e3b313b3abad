"""Build recipe of the tf_poseidon custom-op library.

One recipe for both places that build it: ``setup.py`` (at install time, against the TensorFlow of
the build environment) and ``tf_poseidon/ops.py`` (on first use, into a per-user cache, when the
installed library does not fit the TensorFlow that is running). See docs/kernels.md.

The library is compiled with ``g++`` (or ``$CXX``; ``compiler()`` finds it, or says in one line
how to get one) using ``tf.sysconfig`` flags of the TensorFlow imported by this process, and
carries its *build key* as an embedded string: the TensorFlow version, its ABI-relevant
compile/link flags, the instruction-set flags chosen for this CPU, whether CUDA kernels are in,
and a digest of the sources. A loader compares it with ``build_key()`` without
loading the library (a library built for another TensorFlow must never be loaded).

CUDA kernels are compiled in (``GOOGLE_CUDA=1``) only when the running TensorFlow was built with
CUDA and an ``nvcc`` is found (``$CUDA_HOME/bin``, ``/usr/local/cuda/bin`` or ``PATH``);
``$TF_POSEIDON_NVCC_ARCH`` (e.g. ``sm_90``) replaces the default target architectures.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import tensorflow as tf

KERNEL_DIR = Path(__file__).resolve().parent
CXX_SOURCES = ("poseidon_ops.cc", "poseidon_kernels_cpu.cc", "poseidon_kernels_gpu.cc",
               "poseidon_host_api.cc")
CUDA_SOURCES = ("poseidon_cuda.cu",)
_KEY_MARKER = b"TF_POSEIDON_BUILD_KEY:"
# The float32 environment of TensorFlow's CPU kernels (flush-to-zero, no FMA contraction), so that
# the CUDA kernels give the CPU kernels' bits (kernels/convert.h).
NVCC_NUMERICS = ("-ftz=true", "-fmad=false")
_DEFAULT_NVCC_ARCH = (
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=[sm_90,compute_90]",
)
# x86-64 instruction-set tiers, best first: (cpuinfo flags required, compiler flags). No AVX-512
# tier: on the AMD EPYC (Zen 4) where it was measured, Eigen's AVX-512 GEMM was 1.2-1.4x slower
# than its AVX2 one, and pack/unpack are memory-bound either way (docs/kernels.md).
_X86_TIERS = (
    ({"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"]),
    ({"avx"}, ["-mavx"]),
)

class BuildError(RuntimeError):
    """A compiler or linker step failed; the message holds the command and its output."""


def source_files() -> list[Path]:
    """Every file whose content goes into the library (sources, headers, this recipe)."""
    return sorted(p for p in KERNEL_DIR.iterdir() if p.suffix in {".cc", ".h", ".cu", ".py"})


def compiler() -> str:
    """The C++ compiler to build with: ``$CXX`` if set, else ``g++``, as found on ``PATH``.

    Raises BuildError with a one-line message naming the missing compiler and how to get one;
    setup.py calls this before anything else so that this line ends pip's output.
    """
    name = os.environ.get("CXX") or "g++"
    found = shutil.which(name)
    if found is not None:
        return found
    if os.environ.get("CXX"):
        raise BuildError(f"tf_poseidon needs a C++17 compiler to build its ops: CXX={name} is "
                         "not found on PATH; set CXX to an installed compiler (e.g. CXX=g++)")
    raise BuildError("tf_poseidon needs a C++17 compiler to build its ops: g++ is not found on "
                     "PATH; install it (Debian/Ubuntu: apt install g++; Fedora/RHEL: dnf install "
                     "gcc-c++) or set CXX to another C++17 compiler")


def isa_flags() -> list[str]:
    """Compiler flags of the best instruction-set tier this CPU has (x86-64 Linux), else []."""
    if platform.machine() not in {"x86_64", "AMD64"}:
        return []
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    cpu_flags = set(line.partition(":")[2].split())
    return next((flags for needed, flags in _X86_TIERS if needed <= cpu_flags), [])


def cuda_home() -> Path | None:
    """The CUDA toolkit to build GPU kernels with, or None (CPU-only TensorFlow or no nvcc)."""
    if not tf.test.is_built_with_cuda():
        return None
    candidates = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", _parent_of(shutil.which("nvcc"))]
    for home in filter(None, candidates):
        if (Path(home) / "bin" / "nvcc").is_file():
            return Path(home)
    return None


def _parent_of(nvcc: str | None) -> str | None:
    return str(Path(nvcc).resolve().parent.parent) if nvcc else None


def build_key() -> dict:
    """What a library built here and now would be: compare with ``read_build_key``."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    abi_flags = [f for f in tf.sysconfig.get_compile_flags() if not f.startswith("-I")]
    abi_flags += [f for f in tf.sysconfig.get_link_flags() if not f.startswith("-L")]
    return {
        "tf_version": tf.__version__,
        "abi_flags": abi_flags,
        "isa_flags": isa_flags(),
        "cuda": cuda_home() is not None,
        "sources": digest.hexdigest(),
    }


def read_build_key(library: Path) -> dict | None:
    """The build key embedded in ``library``, or None if it has none (or cannot be read)."""
    try:
        data = Path(library).read_bytes()
    except OSError:
        return None
    start = data.find(_KEY_MARKER)
    if start < 0:
        return None
    start += len(_KEY_MARKER)
    return json.loads(data[start : data.index(b"\0", start)])


def build(library: Path) -> None:
    """Compiles the kernels into ``library`` (replaced atomically). Raises BuildError."""
    library = Path(library)
    library.parent.mkdir(parents=True, exist_ok=True)
    cxx = compiler()
    key = build_key()
    cuda = cuda_home()
    with tempfile.TemporaryDirectory(prefix="tf_poseidon_build_") as tmp:
        work = Path(tmp)
        key_source = work / "build_key.cc"
        key_source.write_text(
            'extern "C" __attribute__((visibility("default"), used)) const char '
            f'tf_poseidon_build_key[] = R"key({_KEY_MARKER.decode()}{json.dumps(key)})key";\n'
        )
        commands = [_cxx_command(cxx, KERNEL_DIR / s, work, cuda) for s in CXX_SOURCES]
        commands.append(_cxx_command(cxx, key_source, work, None))
        if cuda is not None:
            commands += [_nvcc_command(KERNEL_DIR / s, work, cuda) for s in CUDA_SOURCES]
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(_run, commands))
        partial = library.with_name(f".{library.name}.{os.getpid()}.partial")
        link = [cxx, "-shared", "-o", str(partial)]
        link += [c[c.index("-o") + 1] for c in commands]
        link += tf.sysconfig.get_link_flags()
        if cuda is not None:  # static: nothing to find at load time, whatever TF's CUDA libraries
            link += [f"-L{cuda / 'lib64'}", "-lcudart_static", "-ldl", "-lrt", "-lpthread"]
        try:
            _run(link)
            os.replace(partial, library)
        finally:
            partial.unlink(missing_ok=True)


def _cxx_command(cxx: str, source: Path, work: Path, cuda: Path | None) -> list[str]:
    # -ffp-contract=off: no FMA contraction, so results do not depend on the instruction set.
    command = [cxx, "-std=c++17", "-O3", "-DNDEBUG", "-fPIC"]
    command += ["-ffp-contract=off"]
    command += ["-fvisibility=hidden", "-fvisibility-inlines-hidden"]
    command += ["-Wno-deprecated-declarations"]  # TensorFlow's headers use deprecated TSL APIs
    command += tf.sysconfig.get_compile_flags() + isa_flags() + [f"-I{KERNEL_DIR}"]
    if cuda is not None:
        command += ["-DGOOGLE_CUDA=1", f"-I{cuda / 'include'}"]
    return command + ["-c", str(source), "-o", str(work / (source.name + ".o"))]


def _nvcc_command(source: Path, work: Path, cuda: Path) -> list[str]:
    arch = os.environ.get("TF_POSEIDON_NVCC_ARCH")
    command = [str(cuda / "bin" / "nvcc"), "-std=c++17", "-O3", "-Xcompiler", "-fPIC"]
    command += NVCC_NUMERICS
    command += [f"-arch={arch}"] if arch else list(_DEFAULT_NVCC_ARCH)
    return command + [f"-I{KERNEL_DIR}", "-c", str(source), "-o", str(work / (source.name + ".o"))]


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"{' '.join(command)}\n{result.stdout}{result.stderr}")

