"""The ``"lowrank"`` bucket protocol: PowerSGD's two rounds per bucket, on the engine thread.

A member is an ``Item`` of kind ``"lowrank"`` whose shape is its variable's; it is compressed
as the [m, n] matrix :func:`options.matrix_shape` gives. The graph side is the all-reduce's:
the payload is float32 ``[G_1, ..., G_L, c]`` — the members' gradients as the algorithm sends
them (sync: weighted by this rank's batch share, c its example count; c = 1 unweighted) — and
the result, one piece per member, is the low-rank sum in the same units.

``run`` for one bucket, with residual S (kept per rank and member, in the payload's units) and
Q [n, r] (kept per member, equal on every rank):

1. X = G + S; Q̂ = orthonormalize(Q); P = X·Q̂ (members still in warm-up: X itself);
2. round 1: P summed over ranks through the codec (with Σc, exactly);
3. P̂ = orthonormalize(ΣP) — the same bits on every rank, from the same sum;
4. round 2: Q = Σ Xᵀ·P̂ through the codec;
5. result A = P̂·Qᵀ, equal on every rank, and the new residual S ← X − A/P_ranks (PyTorch's
   error feedback: Σ_ranks S is what the applied updates have missed of the exact gradients so
   far). The algorithm scales the result by w = P_ranks/Σc (its batch-share unweighting); when
   w differs from the step the residual was kept at (a short last batch), S also takes
   (w_prev/w − 1)·S_prev, so that the sum of w·S stays exactly what was missed.

At full rank (r = min(m, n)) A is the exact sum and Σ_ranks S stays zero: the steps are exact.
Q is warm-started: each step starts from the previous step's summed Q (the first from a random
matrix seeded by the member's name, the same on every rank). A bucket whose sum is not finite
(a NaN or Inf on some rank) returns NaN for its compressed members and leaves S and Q as they
were: a step the loss-scale check skips leaves no trace. The matrix products run in numpy on
the engine thread, between the rounds, with its BLAS at one thread (blas.py);
docs/compression.md has their cost.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import warnings
import zlib
from typing import Mapping, Sequence

import numpy as np

from tf_poseidon.comm import collectives
from tf_poseidon.comm.buckets import Bucket, Item, aligned_empty, member_slices
from tf_poseidon.comm.codecs import Codec, Exact
from tf_poseidon.comm.protocol import BucketCall, BucketProtocol, BucketResult
from tf_poseidon.lowrank import blas
from tf_poseidon.lowrank.options import PowerSGD, matrix_shape

KIND = "lowrank"
_BLOCK = 1 << 16  # elements per block of the residual update's passes


def item(name: str, shape: Sequence[int]) -> Item:
    """The bucket item of one matrix-shaped gradient (payload: its m·n float32 values)."""
    m, n = matrix_shape(shape)
    return Item(name, tuple(int(d) for d in shape), np.dtype(np.float32), m * n, KIND)


def orthonormalize(a: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning ``a``'s ([k, r], k >= r; float32): a thin Householder QR
    in float64, so a rank-deficient ``a`` (a zero gradient) still gives orthonormal columns.
    A deterministic function of ``a``'s bits on a given host."""
    q, _ = np.linalg.qr(np.asarray(a, np.float64))
    return q.astype(np.float32)


@dataclasses.dataclass
class _MatrixState:
    """What one member keeps between steps."""

    q: np.ndarray | None  # [n, r], equal on every rank; None until its first compressed step
    residual: np.ndarray | None  # [m, n], this rank's S; None while zero
    steps: int  # reductions of this member so far (warm-up ones included)
    weight: float = 0.0  # the w of the step S was kept at (S·w is in the applied update's units)


class LowRankProtocol(BucketProtocol):
    """The protocol of ``"lowrank"`` buckets (module docstring); ``codec`` carries P and Q.

    Holds every member's state, keyed by item name: one protocol object per strategy, used by
    every trace of its train step. ``run`` is engine-thread only; :meth:`state_arrays` (engine
    thread, collective) and :meth:`restore` (any thread) move the state to and from a backup.
    """

    kind = KIND

    def __init__(self, options: PowerSGD, codec: Codec, seed: int = 0):
        self.options = options
        self.codec = codec
        self._seed = seed
        self._states: dict[str, _MatrixState] = {}
        self._lock = threading.Lock()  # the states: run on the engine, restore on the caller
        self._compute = collections.deque(maxlen=256)  # (group id, instance, seconds)
        self._unclaimed: set[str] = set()  # restored members no bucket has named yet

    # -- graph side ------------------------------------------------------------------------

    def pack(self, bucket: Bucket, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """``arrays`` are each member's gradient and count [1] in turn: the payload
        ``[G_1, ..., G_L, c]`` (the count is the same for every member)."""
        values = arrays[0::2]
        total = sum(a.size for a in values)
        payload = aligned_empty(total + 1, np.float32)
        at = 0
        for value in values:
            payload[at:at + value.size] = np.asarray(value, np.float32).ravel()
            at += value.size
        payload[total] = float(np.asarray(arrays[1]).ravel()[0]) if values else 1.0
        return payload

    # -- engine side -----------------------------------------------------------------------

    def run(self, comm, call: BucketCall) -> BucketResult:
        size = comm.Get_size()
        items = call.bucket.items
        payload = call.payload
        total = payload.size - 1
        count = float(payload[total])
        result = payload[:total]
        matrices = [result[part].reshape(matrix_shape(it.shape))
                    for it, part in zip(items, member_slices(call.bucket.sizes))]
        with self._lock, blas.one_thread():
            states = [self._state(it.name, *x.shape) for it, x in zip(items, matrices)]
            compressed = [j for j, s in enumerate(states) if s.steps >= self.options.start_step]
            if not compressed:  # warm-up: the exact sum through the codec
                self.codec.sum_into(comm, result, result)
                for state in states:
                    state.steps += 1
                sent = self.codec.wire_bytes(total, size)
                return BucketResult(result, *sent)
            return self._run_compressed(comm, call, matrices, states, compressed, count,
                                        result)

    def _run_compressed(self, comm, call: BucketCall, matrices: list[np.ndarray],
                        states: list[_MatrixState], compressed: list[int], count: float,
                        result: np.ndarray) -> BucketResult:
        size = comm.Get_size()
        exact = [j for j in range(len(matrices)) if j not in compressed]
        ranks = {j: self.options.matrix_rank(*matrices[j].shape) for j in compressed}
        started = time.perf_counter()
        # Round 1: P = X·Q̂ of each compressed member, then the warm-up members whole.
        layout1 = [matrices[j].shape[0] * ranks[j] for j in compressed] + \
                  [matrices[j].size for j in exact]
        # The count travels in round 1 where the codec sums float32 exactly (small integers);
        # a lossy codec would round it, and scale the bucket by it (fp16): then on its own.
        count_in_round = isinstance(self.codec, Exact)
        first = aligned_empty(sum(layout1) + count_in_round, np.float32)
        pieces = [first[part] for part in member_slices(layout1)]
        q_hats = {}
        for piece, j in zip(pieces, compressed):
            x, state = matrices[j], states[j]
            if state.residual is not None:
                np.add(x, state.residual, out=x)
            q_hats[j] = orthonormalize(state.q)
            np.matmul(x, q_hats[j], out=piece.reshape(x.shape[0], ranks[j]))
        for piece, j in zip(pieces[len(compressed):], exact):
            piece[...] = matrices[j].ravel()
        compute = time.perf_counter() - started
        sent = np.zeros(2)
        sent += self.codec.wire_bytes(first.size, size)
        if count_in_round:
            first[-1] = count
            self.codec.sum_into(comm, first, first)
            count_sum = float(first[-1])
        else:
            self.codec.sum_into(comm, first, first)
            counts = np.array([count])
            comm.Allreduce(collectives.mpi().IN_PLACE, counts, op=collectives.mpi().SUM)
            count_sum = float(counts[0])
            sent += 2 * (size - 1) / size * 8
        for piece, j in zip(pieces[len(compressed):], exact):
            matrices[j].ravel()[...] = piece
            states[j].steps += 1
        started = time.perf_counter()
        finite = all(np.isfinite(piece).all() for piece in pieces[:len(compressed)])
        # Round 2: Q = Xᵀ·P̂ (skipped alike on every rank when round 1 was not finite: every
        # rank holds the same sums).
        p_hats, layout2 = {}, [matrices[j].shape[1] * ranks[j] for j in compressed]
        second = aligned_empty(sum(layout2), np.float32)
        q_pieces = [second[part] for part in member_slices(layout2)]
        if finite:
            for piece, q_piece, j in zip(pieces, q_pieces, compressed):
                m, n = matrices[j].shape
                p_hats[j] = orthonormalize(piece.reshape(m, ranks[j]))
                np.matmul(matrices[j].T, p_hats[j], out=q_piece.reshape(n, ranks[j]))
        compute += time.perf_counter() - started
        if finite:
            self.codec.sum_into(comm, second, second)
            sent += self.codec.wire_bytes(second.size, size)
        started = time.perf_counter()
        weight = size / count_sum if count_sum > 0 else 0.0
        for q_piece, j in zip(q_pieces, compressed):
            x, state = matrices[j], states[j]
            if not finite:
                x[...] = np.nan
                continue
            q = q_piece.reshape(x.shape[1], ranks[j])
            _approximate(state, x, p_hats[j], q, weight, size)
            state.q = q.copy()
            state.steps += 1
        compute += time.perf_counter() - started
        self._compute.append((call.group_id, call.instance, compute))
        # The statistics split a bucket's bytes by its items' shares of the payload: shares
        # in proportion to what each member put on the wire.
        wire = [sum(matrices[j].shape) * ranks[j] if j in ranks else matrices[j].size
                for j in range(len(matrices))]
        item_bytes = tuple(round(call.payload.nbytes * w / sum(wire)) for w in wire)
        return BucketResult(result, float(sent[0]), float(sent[1]), item_bytes)

    def _state(self, name: str, m: int, n: int) -> _MatrixState:
        """``name``'s state, created on first use; checks a restored one fits [m, n]."""
        state = self._states.get(name)
        self._unclaimed.discard(name)
        if state is None:
            if self._unclaimed:
                warnings.warn(
                    f"tf_poseidon low-rank: the restored state holds no entry for {name} but "
                    f"entries for {sorted(self._unclaimed)}: the model's variables have other "
                    "names than when the backup was made, and their residuals start from zero "
                    "(build the model with the same layer names to resume exactly).",
                    RuntimeWarning)
                self._unclaimed.clear()
            state = self._states[name] = _MatrixState(None, None, 0)
        if state.residual is not None and state.residual.shape != (m, n):
            raise ValueError(
                f"tf_poseidon low-rank: the restored residual of {name} has shape "
                f"{state.residual.shape}, but its gradient is compressed as [{m}, {n}]: the "
                "backup belongs to another model.")
        r = self.options.matrix_rank(m, n)
        if state.q is None or state.q.shape != (n, r):
            # A new member, or a backup made with another rank: a fresh random start.
            rng = np.random.default_rng([self._seed, zlib.crc32(name.encode())])
            state.q = rng.standard_normal((n, r), dtype=np.float32)
        return state

    # -- statistics and checkpoints --------------------------------------------------------

    def compute_seconds(self) -> dict[tuple[int, int], float]:
        """Seconds of this rank's low-rank compute (matrix products, orthonormalization,
        residual update) per (group id, instance) of the recent calls. Any thread."""
        totals: dict[tuple[int, int], float] = collections.defaultdict(float)
        for group_id, instance, seconds in list(self._compute):
            totals[(group_id, instance)] += seconds
        return dict(totals)

    def state_arrays(self, comm) -> dict[str, np.ndarray]:
        """Engine thread, collective: the state a backup holds, as named arrays —
        ``<name>/q``, ``<name>/steps``, ``<name>/weight`` and ``<name>/residual``, the
        residuals summed over ranks (complete on rank 0 only: the others' copies lack the
        residuals).

        Raises RuntimeError on every rank if the ranks hold state for different members.
        """
        with self._lock:
            layout = [(name, None if state.residual is None else state.residual.shape)
                      for name, state in sorted(self._states.items())]
            everyone = comm.allgather(layout)
            if any(other != layout for other in everyone):
                raise RuntimeError("tf_poseidon low-rank: ranks hold state for different "
                                   f"matrices ({everyone}); every rank must train the same "
                                   "model.")
            arrays: dict[str, np.ndarray] = {}
            root = comm.Get_rank() == 0
            for name, shape in layout:
                state = self._states[name]
                arrays[f"{name}/steps"] = np.array(state.steps, np.int64)
                arrays[f"{name}/weight"] = np.array(state.weight, np.float64)
                if state.q is not None:
                    arrays[f"{name}/q"] = state.q.copy()
                if shape is not None:
                    summed = np.empty(shape, np.float32) if root else None
                    comm.Reduce(state.residual, summed, op=collectives.mpi().SUM, root=0)
                    if root:
                        arrays[f"{name}/residual"] = summed
            return arrays

    def restore(self, arrays: Mapping[str, np.ndarray], size: int) -> None:
        """Any thread, not collective: takes the state :meth:`state_arrays` saved, on ``size``
        ranks: Q, the step counts and weights as saved, and each rank 1/size of the summed
        residuals (only their sum over ranks matters to every later step). Replaces all
        state."""
        states: dict[str, _MatrixState] = {}
        for key, value in arrays.items():
            name, _, field = key.rpartition("/")
            state = states.setdefault(name, _MatrixState(None, None, 0))
            if field == "steps":
                state.steps = int(value)
            elif field == "weight":
                state.weight = float(value)
            elif field == "q":
                state.q = np.array(value, np.float32)
            elif field == "residual":
                state.residual = np.array(value, np.float32) / np.float32(size)
            else:
                raise ValueError(f"tf_poseidon low-rank: unknown state entry {key!r} in the "
                                 "backup.")
        with self._lock:
            self._states = states
            self._unclaimed = set(states)


def _approximate(state: _MatrixState, x: np.ndarray, p_hat: np.ndarray, q: np.ndarray,
                 weight: float, size: int) -> None:
    """X ← A = P̂·Qᵀ and S ← X − A/P + (w_prev/w − 1)·S, in place (``x`` [m, n] is X = G + S,
    ``p_hat`` [m, r], ``q`` [n, r]; ``weight`` this step's w): S takes X before A overwrites it,
    so no matrix-sized temporary is made and each pass touches one or two matrices."""
    residual = state.residual
    if weight != 0.0:  # weight 0: no rank had examples, nothing was applied or missed
        carried = state.weight / weight - 1.0 if residual is not None else 0.0
        if residual is None:
            residual = state.residual = np.empty_like(x)
        if carried == 0.0:  # w unchanged (every step but a short last one)
            np.copyto(residual, x)
        else:
            residual *= carried
            residual += x
    np.matmul(p_hat, q.T, out=x)
    if weight != 0.0:
        for start in range(0, residual.size, _BLOCK):
            residual.reshape(-1)[start:start + _BLOCK] -= (
                x.reshape(-1)[start:start + _BLOCK] * (1.0 / size))
        state.weight = weight


def compute_once(x: np.ndarray, q: np.ndarray, residual: np.ndarray) -> None:
    """One member's compute in a step on one rank, without the rounds (the cost model times
    it): what ``run`` does to ``x`` [m, n] with ``q`` [n, r] and ``residual`` [m, n] (both
    ``x`` and ``residual`` overwritten)."""
    np.add(x, residual, out=x)
    p_hat = orthonormalize(x @ orthonormalize(q))
    _approximate(_MatrixState(q, residual, 1, 1.0), x, p_hat, x.T @ p_hat, 1.0, 2)
