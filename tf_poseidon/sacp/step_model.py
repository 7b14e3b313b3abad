"""The step time of a model on P ranks under each protocol: the per-layer costs of the cost
model, scheduled as wait-free backprop runs them. For predicting measured step times and
projecting them to more hosts (docs/benchmarks.md, "Scaling prediction").

The model, per step and rank:

* **compute**: ``compute_s`` (the one-process step on a host of its own; with P ranks sharing
  cores, the P-process step without communication), one third forward and two thirds
  backward, each layer's share of the backward pass in proportion to its floating-point
  operations (:func:`layers_of`);
* **readiness**: a gradient exists once the backward pass has passed its layer; all-reduced
  gradients travel in buckets (comm/buckets.py's caps, backprop order), SFB and low-rank ones
  as messages of their own;
* **the engine**: one message at a time, each starting when it is ready and the previous one is
  done; a message of B bytes per rank takes ``B / bandwidth + rounds · latency`` (a ring
  all-reduce 2(P−1) rounds, an all-gather P−1; low-rank two all-reduces), plus its codec's
  passes over the values (16-bit: three at ``convert_bytes_s``);
* **added compute**: SFB's reconstruction, ``2·M·N·(P−1)·K`` flops beyond the local product it
  replaces, and low-rank's own compute, ``M·N / lowrank_elements_s``;
* **the step**: the compute (with the stack's CPU time and the hand-over) or the last message's
  end, whichever is later, plus the added compute (which needs the messages and the cores that
  compute); without overlap (``naive``), compute + every message + the hand-over + the added
  compute.

* **the stack's CPU**: overlapped communication costs the rank's cores ``bytes /
  (stack_bytes_s · cores_per_rank)`` of compute time;
* **the hand-over**: every value a message carries is copied from the graph into the engine's
  buffers and its result back, float32 (4 bytes) each way at ``copy_bytes_s`` (the cost
  model's hand-over: the whole gradient for all-reduce and low-rank, the factors in and the
  gathered factors out for SFB), on the cores that compute;
* **shared cores**: the rates of the added compute and the codec's passes are one core's, so
  where ranks share cores each runs at ``cores_per_rank`` of it (as the compute-only step,
  measured with the ranks sharing, already does).

What it leaves out: the MPI library's own protocol costs (each message is taken to move at the
link's effective rate, as Open MPI's TCP transport does without its put protocol: the MPI
settings in docs/architecture.md), stragglers and contention in the switch, the optimizer's
update after the last bucket (inside compute), and the per-op cost of the graph's hand-over
(comm/graph_ops.py) beyond its copies.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from tf_poseidon.comm import buckets as buckets_lib

PROTOCOLS = ("naive", "allreduce", "fp16", "sfb", "fp16+sfb", "lowrank")
"""``naive``: float32 all-reduce after the backward pass; ``allreduce``: the same overlapped;
``fp16``: 16 bits on the wire; ``sfb``: per Dense kernel SFB or all-reduce, whichever the
estimate finds faster (as the plan weighs them); ``lowrank``: the fastest estimate of
all-reduce, SFB (Dense kernels) and PowerSGD at ``rank`` (matrices it compresses at least 2×),
as the plan weighs them with ``lowrank=`` and ``sfb="auto"``."""


@dataclasses.dataclass(frozen=True)
class Layer:
    """One trainable variable's gradient: ``elements``; ``flops`` of its layer's forward pass
    per example (shared between the layer's variables by elements); ``matrix`` (M, N) if it is
    a matrix (a convolution kernel as [kh·kw·c_in, c_out]); ``sfb_rows`` rows of its Dense
    layer's input per example if SFB can carry it (a Dense kernel on 2-D input: 1), else 0."""

    name: str
    elements: int
    flops: float
    matrix: tuple[int, int] | None = None
    sfb_rows: int = 0


@dataclasses.dataclass(frozen=True)
class Machine:
    """Rates per rank: ``bandwidth_bytes_s`` each way, ``latency_s`` per collective round,
    ``flops_s`` of the SFB reconstruction, ``convert_bytes_s`` of a 16-bit codec's passes,
    ``lowrank_elements_s`` of PowerSGD's compute, ``stack_bytes_s``: the bytes a core sends
    (and receives as many) per second of its own time in the network stack and MPI,
    ``copy_bytes_s`` of a core's memory copy (the hand-over), and
    ``cores_per_rank`` (below 1 where ranks share cores): communication's CPU time comes out
    of the rank's compute, and the other rates, each one core's, run at this fraction."""

    bandwidth_bytes_s: float
    latency_s: float
    flops_s: float
    convert_bytes_s: float
    lowrank_elements_s: float = math.inf
    stack_bytes_s: float = math.inf
    cores_per_rank: float = 1.0
    copy_bytes_s: float = math.inf


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    step_s: float
    compute_s: float  # including the added compute
    comm_s: float  # all messages, end to end on the engine
    bytes_per_rank: float  # sent per step (as many received)


def layers_of(model) -> list[Layer]:
    """The trainable variables of a built Keras ``model``, in creation (forward) order, with
    the forward FLOPs of their layers: Dense 2·M·N per input row, Conv2D 2·kh·kw·c_in·c_out per
    output position; other layers' variables count no FLOPs."""
    import numpy as np
    layers = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        variables = [v for v in layer._trainable_variables]
        if not variables:
            continue
        kernel = getattr(layer, "kernel", None)
        out_shape = tuple(layer.output.shape)[1:] if _has_output(layer) else ()
        flops = 0.0
        if kernel is not None and kernel.shape.rank == 2:
            flops = 2.0 * math.prod(kernel.shape) * math.prod(out_shape[:-1] or (1,))
        elif kernel is not None and kernel.shape.rank == 4:
            flops = 2.0 * math.prod(kernel.shape) * math.prod(out_shape[:-1] or (1,))
        total = sum(int(np.prod(v.shape)) for v in variables)
        for v in variables:
            n = int(np.prod(v.shape))
            shape = tuple(int(d) for d in v.shape)
            matrix = (math.prod(shape[:-1]), shape[-1]) if len(shape) >= 2 else None
            sfb = 1 if (v is kernel and len(shape) == 2 and len(out_shape) == 1) else 0
            layers.append(Layer(v.path if hasattr(v, "path") else v.name, n,
                                flops * n / total, matrix, sfb))
    return layers


def _has_output(layer) -> bool:
    try:
        layer.output
    except (AttributeError, ValueError):
        return False
    return True


def estimate(layers: Sequence[Layer], protocol: str, ranks: int, batch: int,
             compute_s: float, machine: Machine, lowrank_rank: int = 4,
             bucket_bytes: int = buckets_lib.DEFAULT_BUCKET_BYTES,
             first_bucket_bytes: int = buckets_lib.DEFAULT_FIRST_BUCKET_BYTES) -> StepEstimate:
    """The step of ``layers`` (:func:`layers_of`) at ``batch`` rows per rank on ``ranks``
    ranks under ``protocol`` (one of :data:`PROTOCOLS`), given the compute-only step
    ``compute_s`` and the ``machine``'s rates (module docstring)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r}: one of {', '.join(PROTOCOLS)}")
    p, m = ranks, machine
    b = 2 if "fp16" in protocol else 4
    share = m.cores_per_rank
    convert = 3 * 4 / (m.convert_bytes_s * share) if "fp16" in protocol else 0.0  # s/element
    ring = 2 * (p - 1) * m.latency_s
    copy = 4 / (m.copy_bytes_s * share)  # s per float32 value handed over

    def option_s(option: tuple) -> float:  # wire, added compute and hand-over of SFB or low-rank
        wire_s, extra_s, _, values = option
        return wire_s + extra_s + values * copy

    total_flops = sum(layer.flops for layer in layers) or 1.0
    forward, backward = compute_s / 3, 2 * compute_s / 3
    messages, added, handed = [], 0.0, 0.0  # (ready_s, seconds, bytes); values handed over
    bucket = [0.0, 0.0, 0.0, 0]  # ready, seconds, bytes, elements of the open bucket
    done_s, buckets = forward, 0

    def close_bucket():
        nonlocal buckets
        if bucket[3]:
            messages.append((bucket[0], bucket[1] + ring, bucket[2]))
            buckets += 1
        bucket[:] = [0.0, 0.0, 0.0, 0]

    for layer in reversed(layers):  # backprop order
        done_s += backward * layer.flops / total_flops
        n = layer.elements
        allreduce_bytes = 2 * (p - 1) / p * n * b
        allreduce_s = allreduce_bytes / m.bandwidth_bytes_s + n * convert
        others = []  # (wire seconds, added compute seconds, bytes, values handed over)
        if protocol in ("sfb", "fp16+sfb", "lowrank") and layer.sfb_rows and layer.matrix:
            rows, cols = layer.matrix
            k = batch * layer.sfb_rows
            nbytes = (p - 1) * k * (rows + cols) * b
            others.append((nbytes / m.bandwidth_bytes_s + (p - 1) * m.latency_s,
                           2 * rows * cols * (p - 1) * k / (m.flops_s * share), nbytes,
                           (1 + p) * k * (rows + cols)))
        if protocol == "lowrank" and layer.matrix and allreduce_bytes > 0:
            rows, cols = layer.matrix
            nbytes = 2 * (p - 1) / p * (rows + cols) * lowrank_rank * b
            if nbytes < allreduce_bytes / 2:  # PowerSGD's min_compression
                others.append((nbytes / m.bandwidth_bytes_s + 2 * ring,
                               n / (m.lowrank_elements_s * share), nbytes, 2 * n))
        # As the plan weighs them: the fastest estimate, all-reduce on a tie.
        best = min(others, key=option_s, default=None)
        if best is not None and option_s(best) < allreduce_s + 2 * n * copy:
            wire_s, extra_s, nbytes, values = best
            added += extra_s
            handed += values
            messages.append((done_s, wire_s, nbytes))
            continue
        handed += 2 * n
        if bucket[3] and (bucket[3] + n) * 4 > (bucket_bytes if buckets else first_bucket_bytes):
            close_bucket()
        bucket[0] = done_s
        bucket[1] += allreduce_s
        bucket[2] += allreduce_bytes
        bucket[3] += n
    close_bucket()
    comm = sum(seconds for _, seconds, _ in messages)
    end = 0.0
    for ready, seconds, _ in sorted(messages, key=lambda message: message[0]):
        end = max(end, ready) + seconds
    # Overlapped, the stack's CPU time slows the compute it runs beside; the added compute
    # follows the messages it needs, on the cores that compute.
    nbytes = sum(size for _, _, size in messages)
    stack_s = nbytes / (m.stack_bytes_s * share)
    handover_s = handed * copy
    step = (compute_s + comm + handover_s if protocol == "naive"
            else max(compute_s + stack_s + handover_s, end)) + added
    return StepEstimate(step, compute_s + added, comm, nbytes)
