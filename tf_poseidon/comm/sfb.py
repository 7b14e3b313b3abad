"""The SFB path through the engine: factor all-gathers in the same buckets stream as all-reduces.

A training step whose plan sends some Dense kernels by sufficient factors reduces all its
gradients in ONE collective group (:func:`reduce_mixed`), so DWBP works as for all-reduce alone:
items are assigned to buckets in backprop order, every bucket's enqueue runs as soon as its
tensors exist (a layer's factors exist as soon as its output gradient δ does), the engine posts
buckets in index order on every rank, and collects wait for the whole group. A bucket is either

* an all-reduce bucket (gradients summed by the strategy's all-reduce collective, float32 or
  fp16/bf16 — comm/codecs.py), or
* an SFB bucket: the factors U = x [K_l, M_l] and V = δ [K_l, N_l] of one or more layers.

An SFB bucket's payload is float32 ``[K_1..K_L, U_1, V_1, ..., U_L, V_L]`` (the row counts
first: K may differ per rank, e.g. on an uneven last batch). On the engine thread
(:class:`SfbWire`) each factor block is converted to the wire dtype — float32, or fp16/bf16
with a per-block power-of-two scale so that no value overflows fp16 — and gathered in two
rounds: the small fixed-size headers (row counts and scales) by ``Allgather``, then the blocks
by ``Allgatherv``. The result handed back to the graph is float32 ``[R_1..R_L, U_1 stacked,
V_1 stacked, ...]`` with R_l = Σ_p K_lp rows, rank 0's first; the graph reconstructs
ΔW_l = scale·U_lᵀV_l with ``ops.sfb_reconstruct``.

Bytes per rank for a layer (equal K): (P-1)·K·(M+N)·b, b = 4 (float32) or 2, plus the header.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence, Union

import numpy as np
import tensorflow as tf

from tf_poseidon import host_kernels
from tf_poseidon.comm import buckets as buckets_lib
from tf_poseidon.comm import engine as engine_lib
from tf_poseidon.comm import graph_ops
from tf_poseidon.comm.codecs import WIRE_DTYPES
from tf_poseidon.comm.collectives import Collective

FP16_MAX = 65504.0
FP16_TARGET = FP16_MAX / 2  # a block's largest magnitude is scaled to at most this


@dataclasses.dataclass(frozen=True)
class FactorItem:
    """A kernel gradient to reduce by SFB: ΔW = Σ_p U_pᵀ V_p (U [K, M], V [K, N])."""

    name: str  # for stats (the kernel variable's path)
    u: tf.Tensor  # [K, M] float (K may be dynamic)
    v: tf.Tensor  # [K, N]
    m: int
    n: int
    rows_estimate: int  # K for bucket sizing (the plan's)


Item = Union[tf.Tensor, FactorItem]


@dataclasses.dataclass(frozen=True)
class MixedBucket:
    """Bucket ``index`` of a mixed group: ``members`` are positions in the caller's items, all
    plain tensors (kind "allreduce", summed in ``payload_dtype``) or all FactorItems ("sfb")."""

    index: int
    kind: str
    members: tuple[int, ...]
    sizes: tuple[int, ...]  # element counts (for SFB: estimated, K_estimate·(M+N))
    payload_dtype: np.dtype

    @property
    def num_elements(self) -> int:
        return sum(self.sizes)


def plan_mixed(items: Sequence[Item], bucket_bytes: int,
               first_bucket_bytes: int) -> list[MixedBucket]:
    """Buckets for ``items`` (forward order), visited in backprop order (last item first), as
    :func:`buckets.plan_buckets` does: bucket 0 capped at ``first_bucket_bytes``, the others at
    ``bucket_bytes``; all-reduce gradients and factors never share a bucket."""
    buckets: list[MixedBucket] = []
    open_buckets: dict[tuple, tuple[list[int], list[int]]] = {}

    def close(key) -> None:
        members, sizes = open_buckets.pop(key)
        buckets.append(MixedBucket(len(buckets), key[0], tuple(members), tuple(sizes), key[1]))

    for position in range(len(items) - 1, -1, -1):
        item = items[position]
        if isinstance(item, FactorItem):
            key = ("sfb", np.dtype(np.float32))
            n = item.rows_estimate * (item.m + item.n)
        else:
            key = ("allreduce", buckets_lib.payload_dtype(item.dtype))
            n = buckets_lib.static_num_elements(item, f"gradient {position}")
        itemsize = key[1].itemsize
        cap = first_bucket_bytes if not buckets else bucket_bytes
        if key in open_buckets:
            members, sizes = open_buckets[key]
            if (sum(sizes) + n) * itemsize > cap and members:
                close(key)
        members, sizes = open_buckets.setdefault(key, ([], []))
        members.append(position)
        sizes.append(n)
        if sum(sizes) * itemsize >= cap:
            close(key)
    for key in list(open_buckets):
        close(key)
    return buckets


# -- engine side --------------------------------------------------------------------------------


class _SfbPayload(np.ndarray):
    """A float32 payload that carries its bucket's :class:`SfbWire` (attribute ``wire``)."""


class SfbWire:
    """How one SFB bucket travels (runs on the engine thread; see the module docstring)."""

    def __init__(self, group: engine_lib.CollectiveGroup, index: int,
                 layers: Sequence[tuple[str, int, int]], compression: str):
        self.group = group
        self.index = index
        self.layers = list(layers)  # (name, M, N)
        self.wire = (np.dtype(np.float32) if compression == "none"
                     else np.dtype(tf.as_dtype(WIRE_DTYPES[compression]).as_numpy_dtype))
        self.scaled = compression == "fp16"
        self.last_bytes = (0.0, 0.0)

    def run(self, comm, payload: np.ndarray) -> np.ndarray:
        size = comm.Get_size()
        count = len(self.layers)
        payload = np.asarray(payload, np.float32)
        rows = payload[:count].astype(np.int64)
        blocks, offset = [], count
        for (_, m, n), k in zip(self.layers, rows):
            for width in (m, n):
                blocks.append(payload[offset:offset + k * width])
                offset += k * width
        scales = np.array([self._scale(b) for b in blocks], np.float64)
        body = self._to_wire(blocks, scales)
        header = np.concatenate([rows.astype(np.float64), scales])
        headers = np.empty((size, header.size), np.float64)
        comm.Allgather(header, headers)
        all_rows = headers[:, :count].astype(np.int64)  # [P, L]
        widths = np.array([w for _, m, n in self.layers for w in (m, n)], np.int64)
        counts = (np.repeat(all_rows, 2, axis=1) * widths).sum(axis=1)  # elements per rank
        itemsize = self.wire.itemsize
        gathered = np.empty(int(counts.sum()), self.wire)
        displacements = np.concatenate([[0], np.cumsum(counts)[:-1]])
        comm.Allgatherv(body.view(np.uint8), [gathered.view(np.uint8),
                                              (counts * itemsize, displacements * itemsize)])
        result = self._assemble(gathered, all_rows, headers[:, count:], counts, displacements)
        self._account(comm.Get_rank(), counts, header.nbytes, size, all_rows)
        return result

    def _scale(self, block: np.ndarray) -> float:
        if not self.scaled or block.size == 0:
            return 1.0
        amax = host_kernels.max_abs(block)
        if not np.isfinite(amax) or amax == 0.0:
            return 1.0
        return float(2.0 ** np.floor(np.log2(FP16_TARGET / amax)))  # exact to undo

    def _to_wire(self, blocks: list[np.ndarray], scales: np.ndarray) -> np.ndarray:
        body = np.empty(sum(b.size for b in blocks), self.wire)
        at = 0
        for block, scale in zip(blocks, scales):
            host_kernels.convert(block, body[at:at + block.size], scale)
            at += block.size
        return body

    def _assemble(self, gathered: np.ndarray, all_rows: np.ndarray, all_scales: np.ndarray,
                  counts: np.ndarray, displacements: np.ndarray) -> np.ndarray:
        size, count = all_rows.shape
        out = np.empty(count + int(counts.sum()), np.float32)
        out[:count] = all_rows.sum(axis=0)
        # Offsets of each rank's blocks: [U_1, V_1, U_2, V_2, ...] in its segment.
        starts = np.empty((size, 2 * count), np.int64)
        for p in range(size):
            at = displacements[p]
            for layer, (_, m, n) in enumerate(self.layers):
                for j, width in enumerate((m, n)):
                    starts[p, 2 * layer + j] = at
                    at += all_rows[p, layer] * width
        at = count
        for layer, (_, m, n) in enumerate(self.layers):
            for j, width in enumerate((m, n)):
                block = 2 * layer + j
                for p in range(size):
                    length = all_rows[p, layer] * width
                    host_kernels.convert(gathered[starts[p, block]:starts[p, block] + length],
                                         out[at:at + length], 1.0 / all_scales[p, block])
                    at += length
        return out

    def _account(self, rank: int, counts: np.ndarray, header_bytes: int, size: int,
                 all_rows: np.ndarray) -> None:
        itemsize = self.wire.itemsize
        others = float((counts.sum() - counts[rank]) * itemsize + (size - 1) * header_bytes)
        self.last_bytes = (others, others)
        # Per-layer bytes for the statistics (the static estimate replaced by what moved).
        self.group.bucket_layers[self.index] = tuple(
            (name, int(all_rows[rank, layer]) * (m + n) * 4)
            for layer, (name, m, n) in enumerate(self.layers)) or (("sfb", 0),)


def _tagged(arrays: Sequence[np.ndarray], wire: SfbWire) -> _SfbPayload:
    """The float32 payload of ``arrays``, tagged to travel by ``wire`` (see mixed_collective);
    an enqueue's ``pack``."""
    tagged = graph_ops.concatenated(np.dtype(np.float32))(arrays).view(_SfbPayload)
    tagged.wire = wire
    return tagged


def mixed_collective(allreduce: Collective) -> Collective:
    """A Collective that runs SFB payloads (tagged with their SfbWire) by SFB and every other
    bucket by ``allreduce``. Engine thread only; ``wire_bytes`` answers for the bucket just run
    (the engine calls it right after ``run``)."""
    state = {"last": None}

    def run(comm, payload):
        wire = getattr(payload, "wire", None)
        state["last"] = wire
        if wire is None:
            return allreduce.run(comm, payload)
        return wire.run(comm, payload)

    def wire_bytes(payload_bytes, size):
        wire = state["last"]
        if wire is None:
            return allreduce.wire_bytes(payload_bytes, size)
        return wire.last_bytes

    return Collective(f"{allreduce.name}+sfb", run, wire_bytes)


# -- graph side ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GatheredFactors:
    """Every rank's factors of one layer, stacked in rank order: U [R, M], V [R, N]."""

    u: tf.Tensor
    v: tf.Tensor


def reduce_mixed(engine: engine_lib.CommEngine, name: str, items: Sequence[Item],
                 allreduce: Collective, compression: str, sequencer: graph_ops.Sequencer,
                 bucket_bytes: int, first_bucket_bytes: int,
                 names: Sequence[str] | None = None,
                 wait_for: Sequence[tf.Tensor] = ()) -> list:
    """Reduces ``items`` in one collective group: tensors summed over ranks, FactorItems
    gathered.

    Args:
      engine, sequencer: the strategy's.
      name: the group's name in stats and timelines ("gradients" for a training step).
      items: in forward order; tensors with static shapes, and FactorItems.
      allreduce: the collective for the summed tensors (ALLREDUCE_SUM or a codec's).
      compression: "none", "fp16" or "bf16": the wire dtype of the factors.
      bucket_bytes, first_bucket_bytes: caps (see :func:`plan_mixed`).
      names: one per item, for per-layer statistics.
      wait_for: tensors every enqueue waits for (overlap=False).

    Returns:
      Per item: the sum over ranks (same shape and dtype) for a tensor, GatheredFactors for a
      FactorItem. Eager or graph, like :func:`graph_ops.bucketed_collective`.
    """
    names = list(names) if names is not None else [str(i) for i in range(len(items))]
    plan = plan_mixed(items, bucket_bytes, first_bucket_bytes)
    group = engine_lib.CollectiveGroup(name, mixed_collective(allreduce),
                                       graph_ops.bucket_layers(plan, names))
    wires = {}
    tokens = []
    with tf.control_dependencies(list(wait_for)):
        for b in plan:
            if b.kind == "allreduce":
                tokens.append(graph_ops.enqueue(engine, group, b.index,
                                                [items[i] for i in b.members], sequencer,
                                                graph_ops.concatenated(b.payload_dtype)))
                continue
            factors = [items[i] for i in b.members]
            wire = wires[b.index] = SfbWire(group, b.index,
                                            [(names[i], f.m, f.n)
                                             for i, f in zip(b.members, factors)], compression)
            rows = tf.stack([tf.cast(tf.shape(f.u)[0], tf.float32) for f in factors])
            tensors = [rows] + [t for f in factors for t in (f.u, f.v)]
            tokens.append(graph_ops.enqueue(engine, group, b.index, tensors, sequencer,
                                            functools.partial(_tagged, wire=wire)))
    results: list = [None] * len(items)
    for b in plan:
        if b.kind == "allreduce":
            pieces = graph_ops.collect(group, b.index, tokens, b.payload_dtype, b.sizes,
                                       sequencer)
            for position, piece in zip(b.members, pieces):
                value = items[position]
                results[position] = tf.reshape(tf.cast(piece, value.dtype), value.shape)
            continue
        [flat] = graph_ops.collect(group, b.index, tokens, np.dtype(np.float32), None, sequencer)
        factors = [items[i] for i in b.members]
        count = len(factors)
        totals = tf.cast(flat[:count], tf.int32)
        sizes = []
        for j, f in enumerate(factors):
            sizes += [totals[j] * f.m, totals[j] * f.n]
        parts = tf.split(flat[count:], tf.stack(sizes), num=2 * count)
        for j, (position, f) in enumerate(zip(b.members, factors)):
            results[position] = GatheredFactors(tf.reshape(parts[2 * j], [-1, f.m]),
                                                tf.reshape(parts[2 * j + 1], [-1, f.n]))
    return results


def reconstruct(gathered: GatheredFactors, shape: tf.TensorShape, dtype: tf.DType,
                scale: tf.Tensor | float = 1.0) -> tf.Tensor:
    """ΔW = scale·Σ_p U_pᵀ V_p (``ops.sfb_reconstruct``, float32 accumulation), as ``dtype``."""
    from tf_poseidon import ops
    result = ops.sfb_reconstruct(gathered.u, gathered.v, scale)
    return tf.cast(tf.reshape(result, shape), dtype)
