"""The cost model: per layer, all-reduce or another protocol (sufficient factors for Dense
kernels, low-rank approximations for matrices, sparse rows for embeddings), and the rates it
uses.

For a kernel W of M×N, local batch K, P ranks and b bytes per element on the wire:

* ring all-reduce sends (and receives) per rank ``2(P-1)/P·M·N·b`` bytes; each rank also forms
  its local gradient xᵀδ: ``2·M·N·K`` flops;
* SFB all-gathers the factors: ``(P-1)·K·(M+N)·b`` bytes per rank, then reconstructs
  ΔW = Σ_p U_pᵀV_p: ``2·M·N·P·K`` flops (and the local xᵀδ is not computed);
* low-rank (PowerSGD, rank r) all-reduces P [M, r] and Q [N, r]: ``2(P-1)/P·(M+N)·r·b``
  bytes per rank, after the local gradient; its own compute (three thin matrix products, the
  residual's passes) is M·N / the measured low-rank rate.

Estimated times are bytes / bandwidth + compute / compute rate + the hand-over (the values
copied from the graph into the engine's buffers and back, at the measured copy rate: the whole
gradient in and its sum out for all-reduce and low-rank, the factors in and the gathered
factors out for SFB), plus for SFB two network latencies (its all-gather is two rounds, and the
factors travel in a bucket of their own) and a fixed :data:`SFB_OVERHEAD_S` for the hand-over
and unpacking of the gathered factors, and for low-rank its two rounds' latencies and the same
fixed overhead. Gradients whose local batch is unknown (convolution kernels) leave out the
local gradient's compute, which every protocol but SFB pays alike. The bandwidth, latency,
compute and copy rates are measured once by :func:`measure_rates` (a collective: timed
all-reduces, a timed reconstruction, a timed copy and a timed low-rank step, the slowest rank's
times agreed on every rank), or the bandwidth is given
(``PoseidonStrategy(bandwidth_gbps=...)``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Sequence

import numpy as np

SFB_OVERHEAD_S = 1e-3
"""Fixed cost charged to every SFB layer: hand-over to the engine, gathering the header,
unpacking the gathered factors (measured ~0.2–1 ms on 2 busy cores). Keeps small layers, whose
savings are below it, on the all-reduce they share with the other gradients."""

PROBE_BYTES = 4 * 2**20  # the timed all-reduce (above a shaped link's 1 MB burst)
PROBE_MATMUL = (64, 2048, 2048)  # rows R, M, N of the timed reconstruction (16 MB out)
PROBE_LOWRANK = (4096, 2048)  # M, N of the largest timed low-rank compute (32 MB)
PROBE_COPY_BYTES = 32 * 2**20  # the timed copy (beyond the caches, as a large gradient's)


@dataclasses.dataclass(frozen=True)
class Rates:
    """What the cost model assumes about the network and the host (equal on every rank)."""

    bandwidth_bytes_s: float  # per rank and direction
    latency_s: float  # one small collective round
    flops_s: float  # reconstruction (ops.sfb_reconstruct) throughput
    source: str  # "measured", or "bandwidth given" when bandwidth_gbps was passed
    lowrank_elements_s: float = float("nan")  # gradient elements per second of low-rank compute
    copy_bytes_s: float = math.inf  # a rank's memory copy (the hand-over), bytes per second

    def describe(self) -> str:
        text = (f"bandwidth {self.bandwidth_bytes_s * 8 / 1e9:.3g} Gbit/s, latency "
                f"{self.latency_s * 1e3:.3g} ms, reconstruction {self.flops_s / 1e9:.3g} "
                f"GFlop/s")
        if math.isfinite(self.lowrank_elements_s):
            text += f", low-rank {self.lowrank_elements_s / 1e6:.3g} M elements/s"
        if math.isfinite(self.copy_bytes_s):
            text += f", copy {self.copy_bytes_s / 1e9:.3g} GB/s"
        return text + f" ({self.source})"


@dataclasses.dataclass(frozen=True)
class LayerCost:
    bytes_allreduce: float  # per rank, sent (= received) per step
    bytes_sfb: float
    time_allreduce_s: float
    time_sfb_s: float


def handover_s(values: float, rates: Rates) -> float:
    """Seconds to copy ``values`` float32 values between the graph and the engine's buffers
    (the graph holds float32 whatever the codec sends)."""
    return 4 * values / rates.copy_bytes_s


def _whole_gradient_host_s(m: int, n: int, k: int | None, rates: Rates) -> float:
    """The host work of a protocol that takes the whole M×N gradient (all-reduce, low-rank):
    its hand-over in and out and, for a Dense kernel at local batch ``k`` (None otherwise),
    the local product xᵀδ."""
    return handover_s(2 * m * n, rates) + (2 * m * n * k / rates.flops_s if k else 0.0)


def allreduce_time_s(m: int, n: int, k: int | None, num_replicas: int, element_bytes: float,
                     rates: Rates | None) -> float:
    """Estimated seconds per step of all-reducing an M×N gradient (``k`` as for
    :func:`_whole_gradient_host_s`); NaN without ``rates``."""
    if rates is None:
        return float("nan")
    p = num_replicas
    return (2 * (p - 1) / p * m * n * element_bytes / rates.bandwidth_bytes_s
            + _whole_gradient_host_s(m, n, k, rates))


def layer_cost(m: int, n: int, k: int, num_replicas: int, element_bytes: int,
               rates: Rates | None) -> LayerCost:
    """Bytes and estimated seconds per step of both ways of reducing an M×N kernel gradient
    (formulas in the module docstring); times are NaN without ``rates``."""
    p = num_replicas
    bytes_ar = 2 * (p - 1) / p * m * n * element_bytes
    bytes_sfb = (p - 1) * k * (m + n) * element_bytes
    if rates is None:
        return LayerCost(bytes_ar, bytes_sfb, float("nan"), float("nan"))
    time_sfb = (bytes_sfb / rates.bandwidth_bytes_s + 2 * m * n * p * k / rates.flops_s
                + handover_s((1 + p) * k * (m + n), rates) + 2 * rates.latency_s
                + SFB_OVERHEAD_S)
    return LayerCost(bytes_ar, bytes_sfb, allreduce_time_s(m, n, k, p, element_bytes, rates),
                     time_sfb)


@dataclasses.dataclass(frozen=True)
class SparseCost:
    bytes_allreduce: float  # per rank, sent (= received) per step
    bytes_sparse: float
    time_allreduce_s: float
    time_sparse_s: float


def sparse_cost(rows: int, width: int, lookups: int, num_replicas: int, element_bytes: float,
                rates: Rates | None) -> SparseCost:
    """An embedding table of ``rows``×``width`` whose step looks up ``lookups`` rows per rank:
    the dense all-reduce (``2(P-1)/P·rows·width·b``) against gathering every rank's looked-up
    rows with their indices (``(P-1)·lookups·(width·b + 8)``, two rounds: sizes, then rows).
    Times are NaN without ``rates``."""
    p = num_replicas
    bytes_ar = 2 * (p - 1) / p * rows * width * element_bytes
    bytes_sparse = (p - 1) * lookups * (width * element_bytes + 8)
    if rates is None:
        return SparseCost(bytes_ar, bytes_sparse, float("nan"), float("nan"))
    return SparseCost(bytes_ar, bytes_sparse, bytes_ar / rates.bandwidth_bytes_s,
                      bytes_sparse / rates.bandwidth_bytes_s + 2 * rates.latency_s)


@dataclasses.dataclass(frozen=True)
class LowRankCost:
    bytes_allreduce: float  # per rank, sent (= received) per step
    bytes_lowrank: float
    time_allreduce_s: float
    time_lowrank_s: float


def lowrank_cost(m: int, n: int, rank: int, k: int | None, num_replicas: int,
                 element_bytes: float, rates: Rates | None) -> LowRankCost:
    """An M×N gradient summed as a rank-``rank`` approximation (two all-reduces of
    (M+N)·rank values) against the all-reduce of M·N; ``k`` is the local batch when the
    gradient is a Dense kernel's (its local product costs both the same), None otherwise.
    Times are NaN without ``rates`` (or without a measured low-rank rate)."""
    p = num_replicas
    bytes_ar = 2 * (p - 1) / p * m * n * element_bytes
    bytes_lr = 2 * (p - 1) / p * (m + n) * rank * element_bytes
    if rates is None:
        return LowRankCost(bytes_ar, bytes_lr, float("nan"), float("nan"))
    time_lr = (bytes_lr / rates.bandwidth_bytes_s + _whole_gradient_host_s(m, n, k, rates)
               + m * n / rates.lowrank_elements_s + 2 * rates.latency_s + SFB_OVERHEAD_S)
    return LowRankCost(bytes_ar, bytes_lr, allreduce_time_s(m, n, k, p, element_bytes, rates),
                       time_lr)


def sfb_may_pay(m: int, n: int, k: int, num_replicas: int) -> bool:
    """Whether SFB moves fewer bytes at all (P·K·(M+N) < 2·M·N, Poseidon's rule); if not for
    any layer, ``auto`` needs no measurement: all-reduce wins on bytes and on compute."""
    return num_replicas * k * (m + n) < 2 * m * n


def lowrank_probe_shape(shapes: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The matrix whose low-rank compute :func:`measure_rates` times: the largest of
    ``shapes`` (the compressible matrices, as compressed), or :data:`PROBE_LOWRANK` where that
    is smaller. The rate per element falls with the size (the passes leave the caches), so the
    probe takes the size of the matrices that cost most, and beyond the caches no more."""
    largest = max(shapes, key=lambda shape: shape[0] * shape[1], default=PROBE_LOWRANK)
    return min(largest, PROBE_LOWRANK, key=lambda shape: shape[0] * shape[1])


def measure_rates(comm, bandwidth_gbps: float | None, lowrank_rank: int | None = None,
                  lowrank_shape: tuple[int, int] = PROBE_LOWRANK) -> Rates:
    """Collective (every rank, on the engine thread, blocking for ~0.1–1 s): times small and
    ``PROBE_BYTES`` all-reduces (unless ``bandwidth_gbps`` is given), a reconstruction of
    :data:`PROBE_MATMUL`, a copy of :data:`PROBE_COPY_BYTES` (:func:`time_copy`) and, with
    ``lowrank_rank``, the low-rank compute of a ``lowrank_shape`` matrix at that rank
    (:func:`time_lowrank`); every rank gets the same Rates (the slowest rank's times). The
    compute and the copy are timed on every rank at once, as a step runs them, so ranks that
    share cores measure the rate they get in a step."""
    from mpi4py import MPI

    from tf_poseidon import ops

    def timed_allreduce(buffer: np.ndarray, repeats: int) -> list[float]:
        times = []
        for _ in range(repeats):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
            times.append(time.perf_counter() - start)
        return times

    r, m, n = PROBE_MATMUL
    rng = np.random.default_rng(0)
    u = rng.standard_normal((r, m), dtype=np.float32)
    v = rng.standard_normal((r, n), dtype=np.float32)
    ops.sfb_reconstruct(u, v)  # warm-up (and op loading)
    comm.Barrier()
    matmul_s = _best_seconds(lambda: ops.sfb_reconstruct(u, v).numpy())
    comm.Barrier()
    copy_s = time_copy()
    comm.Barrier()
    lowrank_s = time_lowrank(lowrank_rank, lowrank_shape) if lowrank_rank is not None else 0.0
    small = np.zeros(2, np.float32)
    timed_allreduce(small, 2)  # warm-up
    latency = statistics.median(timed_allreduce(small, 5))
    big_time = 0.0
    if bandwidth_gbps is None:
        big = np.zeros(PROBE_BYTES // 4, np.float32)
        big_time = min(timed_allreduce(big, 3))  # min: the capacity, not the noise
    # The slowest rank's figures, on every rank.
    figures = np.array([matmul_s, latency, big_time, lowrank_s, copy_s], np.float64)
    comm.Allreduce(MPI.IN_PLACE, figures, op=MPI.MAX)
    matmul_s, latency, big_time, lowrank_s, copy_s = (float(f) for f in figures)
    flops = 2 * r * m * n / max(matmul_s, 1e-9)
    size = comm.Get_size()
    if bandwidth_gbps is None:
        moved = 2 * (size - 1) / size * PROBE_BYTES
        bandwidth = moved / max(big_time - latency, 1e-9)
        source = "measured"
    else:
        bandwidth = bandwidth_gbps * 1e9 / 8
        source = "bandwidth given"
    lowrank_rate = (lowrank_shape[0] * lowrank_shape[1] / max(lowrank_s, 1e-9)
                    if lowrank_rank is not None else float("nan"))
    return Rates(bandwidth, latency, flops, source, lowrank_rate,
                 PROBE_COPY_BYTES / max(copy_s, 1e-9))


def time_lowrank(rank: int, shape: tuple[int, int] = PROBE_LOWRANK) -> float:
    """Seconds (best of 3, after a warm-up) of one rank's low-rank compute on a ``shape``
    matrix: the protocol's own steps on one rank, without the rounds."""
    from tf_poseidon.lowrank import blas, protocol
    m, n = shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, n), dtype=np.float32)
    q = rng.standard_normal((n, rank), dtype=np.float32)
    residual = np.zeros_like(x)
    with blas.one_thread():
        protocol.compute_once(x, q, residual)
        return _best_seconds(lambda: protocol.compute_once(x, q, residual))


def time_copy() -> float:
    """Seconds (best of 3) of one rank copying :data:`PROBE_COPY_BYTES` of float32 from one
    buffer to another, as the hand-over copies a gradient."""
    source = np.ones(PROBE_COPY_BYTES // 4, np.float32)
    target = np.empty_like(source)
    return _best_seconds(lambda: np.copyto(target, source))


def _best_seconds(run, repeats: int = 3) -> float:
    """The shortest of ``repeats`` timed calls of ``run``: the capacity, not the noise."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)
