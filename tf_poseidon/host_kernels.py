"""The CPU kernels of ``kernels/`` on numpy buffers, for the communication engine thread and
the numpy_function ops that hand it buckets.

:mod:`tf_poseidon.ops` runs the kernels as TensorFlow ops on tensors. The engine thread
(comm/engine.py) converts and sums buckets between MPI calls on numpy buffers that it owns and
reuses; a TensorFlow op there would allocate a fresh output per call (page-faulting through
every large one) and need a copy in and out, which measured as much time as the conversion
itself. These functions run the same element loops (``kernels/cpu_loops.h``) through the op
library's C API (``kernels/poseidon_host_api.cc``), on the caller's arrays, in the calling thread
(single-threaded), with the GIL released. When the compiled library is unavailable
(``ops.available()`` is False, with its warning) numpy does the same arithmetic, more slowly;
with ``TF_POSEIDON_REQUIRE_OPS=1`` that is a RuntimeError instead.

Arrays: C-contiguous numpy arrays of float32, float16 or bfloat16 (``tf.bfloat16.as_numpy_dtype``);
anything else raises ValueError naming the argument.
All functions block until done.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from tf_poseidon import ops

__all__ = ["available", "convert", "sum_chunks", "max_abs"]

# poseidon::Dtype (kernels/convert.h)
_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}

_lock = threading.Lock()
_state: dict[str, object] = {}


def available() -> bool:
    """Whether the compiled loops serve these functions (else numpy does)."""
    return _c_api() is not None


def convert(src: np.ndarray, dst: np.ndarray, scale: float = 1.0) -> None:
    """``dst[i] = dst.dtype(float32(src[i]) * scale)`` for every element, rounded to nearest
    even; NaN and Inf propagate, finite values beyond float16's range become ±Inf in float16.

    ``src`` and ``dst`` must hold the same number of elements (shapes may differ) and must not
    overlap unless they are the same array of one dtype.
    """
    src_code, dst_code = _code(src, "src"), _code(dst, "dst")
    if src.size != dst.size:
        raise ValueError(f"convert: src has {src.size} elements but dst has {dst.size}")
    api = _c_api()
    if api is None:
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(dst.reshape(-1), (src.reshape(-1).astype(np.float32) * np.float32(scale))
                      .astype(dst.dtype), casting="unsafe")
        return
    api.poseidon_host_convert(src.ctypes.data, src_code, dst.ctypes.data, dst_code, src.size,
                              scale)


def sum_chunks(chunks: np.ndarray, out: np.ndarray, scale: float = 1.0) -> None:
    """``out[j] = out.dtype(scale * Σ_p float32(chunks[p, j]))``, summed in order p = 0, 1, ...
    in float32 (so every rank summing the same chunks gets the same bits); NaN/Inf propagate.

    ``chunks``: ``[P, n]``; ``out``: ``n`` elements.
    """
    chunks_code, out_code = _code(chunks, "chunks"), _code(out, "out")
    if chunks.ndim != 2 or out.size != chunks.shape[1]:
        raise ValueError(f"sum_chunks: chunks must be [P, n] and out have n elements, got "
                         f"chunks {chunks.shape} and out {out.shape}")
    api = _c_api()
    if api is None:
        total = np.zeros(chunks.shape[1], np.float32)
        for chunk in chunks:  # in rank order, as the compiled loop
            total += chunk.astype(np.float32)
        convert(total, out, scale)
        return
    api.poseidon_host_sum_chunks(chunks.ctypes.data, chunks_code, chunks.shape[0],
                                 chunks.shape[1], scale, out.ctypes.data, out_code)


def max_abs(x: np.ndarray) -> float:
    """The largest ``|x[i]|`` of a float32 array: NaN if any element is NaN, else Inf if any is
    infinite; 0.0 for an empty array."""
    if _code(x, "x") != _DTYPE_CODES["float32"]:
        raise ValueError(f"max_abs: x must be float32, got {x.dtype}")
    api = _c_api()
    if api is None:
        if x.size == 0:
            return 0.0
        return float(np.max(np.abs(x)))  # np.max propagates NaN
    bits = np.array([api.poseidon_host_max_abs_bits(x.ctypes.data, x.size)], np.uint32)
    return float(bits.view(np.float32)[0])


def _code(array: np.ndarray, name: str) -> int:
    code = _DTYPE_CODES.get(array.dtype.name) if isinstance(array, np.ndarray) else None
    if code is None:
        raise ValueError(f"{name} must be a numpy array of float32, float16 or bfloat16, got "
                         f"{getattr(array, 'dtype', type(array).__name__)}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (np.ascontiguousarray)")
    return code


def _c_api() -> ctypes.CDLL | None:
    """The op library's C API (loaded once), None when the compiled library is unavailable."""
    with _lock:
        if "api" not in _state:
            path = ops.library_path()  # raises with TF_POSEIDON_REQUIRE_OPS=1 if unavailable
            _state["api"] = None if path is None else _declare(ctypes.CDLL(str(path)))
        return _state["api"]


def _declare(api: ctypes.CDLL) -> ctypes.CDLL:
    i32, i64, f32, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    api.poseidon_host_convert.argtypes = [ptr, i32, ptr, i32, i64, f32]
    api.poseidon_host_convert.restype = None
    api.poseidon_host_sum_chunks.argtypes = [ptr, i32, i64, i64, f32, ptr, i32]
    api.poseidon_host_sum_chunks.restype = None
    api.poseidon_host_max_abs_bits.argtypes = [ptr, i64]
    api.poseidon_host_max_abs_bits.restype = ctypes.c_uint32
    return api
