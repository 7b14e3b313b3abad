"""Fused communication kernels (the "kernels" box of docs/architecture.md): the compiled
TensorFlow ops.

* ``pack`` / ``unpack``: gradients <-> one flat wire buffer (float32, float16 or bfloat16),
  scaled in float32 on the way, in one pass. On the data path they are the device form of an
  all-reduce bucket (comm/datapath.py chooses it where the gradients live on a GPU;
  comm/protocol.py: ``DevicePacked`` packs before the copy to the host and unpacks after it).
* ``sum_chunks``: float32-accumulating sum of P wire chunks, the local step of a reduce-scatter.
  Not on the data path: the engine thread sums numpy wire buffers with the same loop through
  ``host_kernels.sum_chunks`` (comm/codecs.py). The op and that loop are tested against the
  same numpy reference (tests/test_ops.py, tests/test_host_kernels.py); the op awaits a
  device-side reduction.
* ``sfb_reconstruct``: ``scale * U^T V`` in float32, sufficient-factor reconstruction
  (sfb/protocol.py; sacp/cost_model.py times it to estimate SFB's cost).

Every function works eagerly (from any thread, on tensors or numpy arrays) and inside
``tf.function``; none has a gradient (they act on gradients, and report ``None`` to a tape).
Each has a CPU and, in a CUDA TensorFlow, a GPU kernel, placed like any TensorFlow op; on both
float32 denormals count as zeros (TensorFlow's flush-to-zero), and the GPU kernels of pack,
unpack and sum_chunks give the CPU kernels' bits.

Which implementation runs. The C++ (and, in a CUDA TensorFlow, CUDA) kernels of ``kernels/`` are
compiled at install time into ``tf_poseidon/_poseidon_ops.so``. On first use that library is loaded
if its embedded build key (TensorFlow version and ABI flags, CPU instruction set, CUDA or not,
source digest; see kernels/build.py) equals the key of the running process; otherwise the kernels
are compiled once into ``$XDG_CACHE_HOME/tf_poseidon/<tf version>-<key digest>/`` (default
``~/.cache``; a file lock makes concurrent ranks build once) and loaded from there. If that fails
too, a ``RuntimeWarning`` is issued and ``CompositeOps`` (same contracts, stock TensorFlow ops,
slower) are used, unless ``TF_POSEIDON_REQUIRE_OPS=1``, which makes the failure a RuntimeError on
every call. ``available()`` tells which is in use. See docs/kernels.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Union

import tensorflow as tf

__all__ = ["available", "pack", "unpack", "sum_chunks", "sfb_reconstruct", "CompositeOps",
           "library_path"]

LIBRARY_NAME = "_poseidon_ops.so"
REQUIRE_ENV = "TF_POSEIDON_REQUIRE_OPS"

Scale = Union[float, tf.Tensor]
ShapeLike = Union[tf.TensorShape, Sequence[int]]

_OP_TYPES = ("PoseidonPack", "PoseidonUnpack", "PoseidonSumChunks", "PoseidonSfbReconstruct")
for _op_type in _OP_TYPES:
    tf.no_gradient(_op_type)

_log = logging.getLogger(__name__)


def available() -> bool:
    """Whether the compiled kernels are in use (loading, or building, them on the first call).

    False means ``CompositeOps`` serve the calls (a warning said why); with
    ``TF_POSEIDON_REQUIRE_OPS=1`` this raises RuntimeError instead of returning False.
    """
    return _library() is not None


def pack(tensors: Sequence[tf.Tensor], wire_dtype: tf.DType, scale: Scale = 1.0) -> tf.Tensor:
    """Flattens and concatenates ``tensors`` into one 1-D ``wire_dtype`` buffer, times ``scale``.

    Args:
      tensors: N >= 0 tensors (or arrays) of float32, float16 or bfloat16, any shapes, dtypes may
        differ.
      wire_dtype: float32, float16 or bfloat16.
      scale: float32 scalar. Each element is ``wire_dtype(float32(x) * scale)`` (round to nearest
        even); choose ``scale`` so that ``|x| * scale <= 65504`` for float16 or values become inf.

    Returns:
      ``[sum of the sizes]`` tensor of ``wire_dtype``, tensors in order, each in row-major order.
      NaN and Inf propagate; a NaN keeps its sign (and, in float32, its payload, quieted). A
      dtype outside the three raises TypeError/InvalidArgumentError.
    """
    return _backend().pack(
        [tf.convert_to_tensor(t) for t in tensors], tf.as_dtype(wire_dtype), _scale(scale)
    )


def unpack(
    buffer: tf.Tensor,
    shapes: Sequence[ShapeLike],
    dtypes: Sequence[tf.DType],
    unscale: Scale = 1.0,
) -> list[tf.Tensor]:
    """Inverse of ``pack``: splits ``buffer`` into tensors of ``shapes`` and ``dtypes``.

    Args:
      buffer: 1-D float32, float16 or bfloat16 tensor with exactly ``sum(prod(shape))`` elements
        (else InvalidArgumentError naming the expected shape).
      shapes: fully defined shapes (ValueError otherwise); their static shapes are the outputs'.
      dtypes: one float32, float16 or bfloat16 dtype per shape.
      unscale: float32 scalar; each element is ``dtype(float32(x) * unscale)``.

    Returns:
      One tensor per shape. ``unpack(pack(ts, w, s), shapes, dtypes, 1 / s)`` gives ``ts`` back up
      to the rounding of the wire dtype.
    """
    shapes = [tf.TensorShape(shape) for shape in shapes]
    dtypes = [tf.as_dtype(dtype) for dtype in dtypes]
    if len(shapes) != len(dtypes):
        raise ValueError(f"unpack: {len(shapes)} shapes but {len(dtypes)} dtypes")
    for i, shape in enumerate(shapes):
        if not shape.is_fully_defined():
            raise ValueError(f"unpack: shapes[{i}] must be fully defined, got {shape}")
    return _backend().unpack(tf.convert_to_tensor(buffer), shapes, dtypes, _scale(unscale))


def sum_chunks(
    chunks: tf.Tensor, scale: Scale = 1.0, out_dtype: tf.DType = tf.float32
) -> tf.Tensor:
    """Sums P wire chunks in float32: ``out[j] = out_dtype(scale * sum_p float32(chunks[p, j]))``.

    Args:
      chunks: ``[P, n]`` float32, float16 or bfloat16 (the P ranks' pieces of one reduce-scatter
        segment); another rank raises InvalidArgumentError. P = 0 gives zeros.
      scale: float32 scalar applied after the sum (e.g. 1/P for a mean, or the unscale of fp16).
      out_dtype: float32 (default), float16 or bfloat16 (e.g. the wire dtype, to all-gather next).

    Returns:
      ``[n]`` of ``out_dtype``. The sum runs in order p = 0, 1, ..., so every rank summing the same
      chunks gets bit-identical results; NaN/Inf propagate.
    """
    return _backend().sum_chunks(
        tf.convert_to_tensor(chunks), _scale(scale), tf.as_dtype(out_dtype)
    )


def sfb_reconstruct(u: tf.Tensor, v: tf.Tensor, scale: Scale = 1.0) -> tf.Tensor:
    """Reconstructs a dense layer's weight gradient from sufficient factors: ``scale * u^T v``.

    Args:
      u: ``[R, M]`` stacked layer inputs (R = P * K rows), float32, float16 or bfloat16.
      v: ``[R, N]`` stacked output gradients, same dtype as ``u``; a different R, or R, M or
        N of 2^31 or more (a GEMM's int dimensions, on every device), raises
        InvalidArgumentError.
      scale: float32 scalar (e.g. 1/P for a mean).

    Returns:
      ``[M, N]`` float32, accumulated in float32 (R = 0 gives zeros). On a GPU this is one
      cuBLAS GEMM (TensorFlow's own); float32 factors are then rounded to TensorFloat-32 exactly
      when ``tf.config.experimental.tensor_float_32_execution_enabled()``, as in ``tf.matmul``.
    """
    u, v = tf.convert_to_tensor(u), tf.convert_to_tensor(v)
    return _backend().sfb_reconstruct(u, v, _scale(scale))


def _scale(scale: Scale) -> tf.Tensor:
    return tf.convert_to_tensor(scale, tf.float32)


class CompositeOps:
    """The four contracts in stock TensorFlow ops (cast/reshape/concat, split/reshape/cast, ...).

    The fallback when the compiled kernels are unavailable, and the baseline of
    benchmarks/kernels.py. Same results up to float summation order; bad inputs raise
    TensorFlow's own errors of the underlying ops.
    """

    @staticmethod
    def pack(tensors: list[tf.Tensor], wire_dtype: tf.DType, scale: tf.Tensor) -> tf.Tensor:
        """See ``pack``."""
        flat = [tf.reshape(tf.cast(t, tf.float32) * scale, [-1]) for t in tensors]
        return tf.cast(tf.concat(flat, 0), wire_dtype) if flat else tf.zeros([0], wire_dtype)

    @staticmethod
    def unpack(
        buffer: tf.Tensor, shapes: list[tf.TensorShape], dtypes: list[tf.DType], unscale: tf.Tensor
    ) -> list[tf.Tensor]:
        """See ``unpack``."""
        sizes = [shape.num_elements() for shape in shapes]
        parts = tf.split(tf.cast(buffer, tf.float32) * unscale, sizes) if sizes else []
        return [tf.cast(tf.reshape(p, s), d) for p, s, d in zip(parts, shapes, dtypes)]

    @staticmethod
    def sum_chunks(chunks: tf.Tensor, scale: tf.Tensor, out_dtype: tf.DType) -> tf.Tensor:
        """See ``sum_chunks``."""
        return tf.cast(tf.reduce_sum(tf.cast(chunks, tf.float32), 0) * scale, out_dtype)

    @staticmethod
    def sfb_reconstruct(u: tf.Tensor, v: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
        """See ``sfb_reconstruct``."""
        u32 = tf.cast(u, tf.float32) * scale
        return tf.matmul(u32, tf.cast(v, tf.float32), transpose_a=True)


class _CompiledOps:
    """The four contracts served by the loaded op library."""

    def __init__(self, library: ModuleType) -> None:
        self._lib = library

    def pack(self, tensors: list[tf.Tensor], wire_dtype: tf.DType, scale: tf.Tensor) -> tf.Tensor:
        return self._lib.poseidon_pack(tensors=tensors, scale=scale, wire_dtype=wire_dtype)

    def unpack(
        self,
        buffer: tf.Tensor,
        shapes: list[tf.TensorShape],
        dtypes: list[tf.DType],
        unscale: tf.Tensor,
    ) -> list[tf.Tensor]:
        return self._lib.poseidon_unpack(
            packed=buffer, unscale=unscale, out_types=dtypes, shapes=shapes
        )

    def sum_chunks(self, chunks: tf.Tensor, scale: tf.Tensor, out_dtype: tf.DType) -> tf.Tensor:
        return self._lib.poseidon_sum_chunks(chunks=chunks, scale=scale, out_dtype=out_dtype)

    def sfb_reconstruct(self, u: tf.Tensor, v: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
        return self._lib.poseidon_sfb_reconstruct(u=u, v=v, scale=scale)


# Loading: done once per process, under _LOCK, on the first call of any function above.
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {}


def _backend() -> _CompiledOps | type[CompositeOps]:
    library = _library()
    return CompositeOps if library is None else _CompiledOps(library)


def _library() -> ModuleType | None:
    """The loaded op library, or None (after one warning) when the composite fallback is in use."""
    with _LOCK:
        if "library" not in _STATE:
            try:
                _STATE["library"] = _load_library()
            except Exception as error:  # noqa: BLE001 - any failure to build or load means fallback
                _STATE["library"], _STATE["error"] = None, error
                if os.environ.get(REQUIRE_ENV) != "1":
                    warnings.warn(
                        f"tf_poseidon: compiled ops unavailable, using slower composite "
                        f"TensorFlow ops: {error}",
                        RuntimeWarning,
                        stacklevel=3,
                    )
        if _STATE["library"] is None and os.environ.get(REQUIRE_ENV) == "1":
            raise RuntimeError(
                f"tf_poseidon: compiled ops are required ({REQUIRE_ENV}=1) but unavailable: "
                f"{_STATE['error']}"
            ) from _STATE["error"]
        return _STATE["library"]


def library_path() -> Path | None:
    """The file of the loaded op library (loading it first), None when the composite fallback
    is in use. tf_poseidon/host_kernels.py calls the same library's C API."""
    return None if _library() is None else _STATE["path"]


def _load_library() -> ModuleType:
    build = _build_recipe()
    key = build.build_key()
    path = Path(__file__).with_name(LIBRARY_NAME)
    if build.read_build_key(path) != key:
        path = _cached_library(build, key)
    library = tf.load_op_library(str(path))
    _STATE["path"] = path
    return library


def _cached_library(build: ModuleType, key: dict) -> Path:
    """The library for ``key`` in the per-user cache, compiled there first if missing."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    directory = cache_home / "tf_poseidon" / f"{key['tf_version']}-{digest}"
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / LIBRARY_NAME
    with open(directory / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if build.read_build_key(library) != key:
            _log.warning(
                "tf_poseidon: compiling the kernels for TensorFlow %s into %s (once)",
                key["tf_version"],
                directory,
            )
            build.build(library)
    return library


def _build_recipe() -> ModuleType:
    """kernels/build.py: installed as tf_poseidon/_kernels, or beside the package in a checkout."""
    package = Path(__file__).resolve().parent
    for kernel_dir in (package / "_kernels", package.parent / "kernels"):
        recipe = kernel_dir / "build.py"
        if recipe.is_file():
            spec = importlib.util.spec_from_file_location("tf_poseidon._kernel_build", recipe)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise FileNotFoundError(f"tf_poseidon kernel sources not found beside {package}")
