"""One BLAS thread for the low-rank protocol's matrix products on the engine thread.

numpy's OpenBLAS starts as many threads as the host has cores and lets them spin between
calls. The protocol's products (a gradient times a thin matrix) are small and run beside
TensorFlow's backward pass, whose thread pools already hold the cores: measured on 2 busy
cores, the protocol's compute on a 1024×1024 gradient took 2.0 ms at one BLAS thread and 32 ms
at the default two (docs/compression.md). :func:`one_thread` sets numpy's OpenBLAS to one
thread for the duration of a bucket and restores the previous count after, through OpenBLAS's
own ``openblas_set_num_threads`` found among the libraries numpy loaded. Where numpy uses
another BLAS (or none is found) it does nothing; ``OPENBLAS_NUM_THREADS=1`` or
``OMP_NUM_THREADS=1`` in the environment have the same effect for the whole process.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Iterator

# (setter, getter) symbol names of OpenBLAS's thread count, as numpy's wheels build it
# (scipy-openblas, 64-bit integers) and as other builds do.
_SYMBOLS = [(f"{prefix}openblas_set_num_threads{suffix}",
             f"{prefix}openblas_get_num_threads{suffix}")
            for prefix in ("scipy_", "") for suffix in ("64_", "")]
_lock = threading.Lock()
_controls: list[tuple] | None = None


def _numpy_openblas() -> list[tuple]:
    """The (set, get) functions of each OpenBLAS numpy has loaded (empty if none)."""
    import numpy
    package = os.path.dirname(os.path.abspath(numpy.__file__))
    roots = (package, package + ".libs", os.path.join(os.path.dirname(package), "numpy.libs"))
    try:
        with open("/proc/self/maps") as f:
            mapped = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return []
    controls = []
    for path in sorted(mapped):
        if not path.startswith(roots):
            continue
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in _SYMBOLS:
            setter = getattr(library, set_name, None)
            getter = getattr(library, get_name, None)
            if setter is not None and getter is not None:
                setter.argtypes, setter.restype = [ctypes.c_int], None
                getter.argtypes, getter.restype = [], ctypes.c_int
                controls.append((setter, getter))
                break
    return controls


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Within it, numpy's OpenBLAS runs on one thread (process-wide: a numpy product another
    thread runs meanwhile is single-threaded too). Engine thread; not reentrant."""
    global _controls
    with _lock:
        if _controls is None:
            _controls = _numpy_openblas()
    previous = [get() for _, get in _controls]
    for set_threads, _ in _controls:
        set_threads(1)
    try:
        yield
    finally:
        for (set_threads, _), count in zip(_controls, previous):
            set_threads(count)
