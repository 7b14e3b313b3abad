"""The per-layer plan: which protocol carries each Dense kernel's gradient, agreed by every rank.

:class:`Planner` is what the sync algorithm asks, while it traces a train step, which gradients
go by SFB (sfb/) and which by all-reduce. :func:`agree` is its collective, called with what
this rank captured. It is a collective: every rank sends its candidates (kernel names, shapes, local
batch), the ranks check they traced the same layers, take the largest local batch of each
layer, measure the rates if the cost model needs them (once per process), compute the choices
from these identical inputs and finally all use rank 0's choices — so every rank builds the
same buckets and the collectives always match. :class:`Plan` is what ``strategy.plan()``
returns: the table, one row per Dense kernel.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import tensorflow as tf

from tf_poseidon.sacp import cost_model

ASSUMED_LOCAL_BATCH = 128
"""The local batch K the cost model assumes for a layer whose batch dimension is unknown when
the step is traced (a data set whose last batch is short). The choice depends on K only near
the layer's break-even batch, which for wide layers is far above this."""

SFB, SPARSE, ALLREDUCE = "sfb", "sparse", "allreduce"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A gradient that another protocol than all-reduce might carry: a Dense kernel's (SFB;
    also a Dense layer skipped at capture) or an embedding's sparse rows (``IndexedSlices``).

    For SFB, (m, n) is the kernel's shape and ``rows`` the local batch K; for sparse, (m, n) is
    the table's (rows, width) and ``rows`` the number of rows looked up per step.
    """

    kernel: str  # variable path
    m: int | None
    n: int | None
    rows: int | None  # this rank's static K (or lookups), None if dynamic
    refusal: str | None  # why the protocol cannot carry it, None if it can
    protocol: str = SFB
    lookups_per_example: int = 1  # sparse: rows looked up per example, for a dynamic batch


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One row of the plan: all-reduce against the ``alternative`` protocol. Bytes are per
    rank and step, sent (as many are received)."""

    kernel: str
    shape: tuple[int, int] | None
    local_batch: int | None  # the K (or lookups) the estimate used (largest over ranks)
    batch_assumed: bool  # True when K was unknown at trace time and ASSUMED_LOCAL_BATCH used
    bytes_allreduce: float
    bytes_alternative: float
    time_allreduce_s: float  # NaN when no rates were measured or given
    time_alternative_s: float
    choice: str  # "allreduce" or the alternative
    reason: str
    alternative: str = SFB

    def as_dict(self) -> dict:
        """JSON-serialisable, with the alternative's figures as ``bytes_<protocol>`` and
        ``time_<protocol>_s`` (NaN becomes None)."""
        row = dataclasses.asdict(self)
        row[f"bytes_{self.alternative}"] = row.pop("bytes_alternative")
        row[f"time_{self.alternative}_s"] = row.pop("time_alternative_s")
        return {k: None if isinstance(v, float) and math.isnan(v) else v
                for k, v in row.items()}


@dataclasses.dataclass
class Plan:
    """What ``strategy.plan()`` returns: the per-layer choices of the last traced train step."""

    rows: list[LayerPlan]
    num_replicas: int
    sfb: str
    compression: str
    rates: cost_model.Rates | None = None
    note: str = ""

    def choice(self, kernel: str) -> str | None:
        """The protocol chosen for the variable path ``kernel`` (None if unknown)."""
        return next((row.choice for row in self.rows if row.kernel == kernel), None)

    @property
    def sfb_kernels(self) -> list[str]:
        return [row.kernel for row in self.rows if row.choice == SFB]

    def as_dict(self) -> dict:
        """JSON-serialisable form (NaN times become None)."""
        return {"num_replicas": self.num_replicas, "sfb": self.sfb,
                "compression": self.compression, "note": self.note,
                "rates": dataclasses.asdict(self.rates) if self.rates else None,
                "rows": [r.as_dict() for r in self.rows]}

    def table(self) -> str:
        head = (f"Per-layer plan: P={self.num_replicas}, sfb={self.sfb!r}, "
                f"compression={self.compression!r}")
        if self.rates is not None:
            head += f"; {self.rates.describe()}"
        lines = [head]
        if self.note:
            lines.append(self.note)
        if not self.rows:
            return "\n".join(lines)
        header = ("layer (variable)", "shape", "K", "all-reduce", "other", "t all-reduce",
                  "t other", "choice", "reason")
        body = [(r.kernel, f"{r.shape[0]}x{r.shape[1]}" if r.shape else "?",
                 (f"{r.local_batch}?" if r.batch_assumed else str(r.local_batch))
                 if r.local_batch is not None else "-",
                 _bytes(r.bytes_allreduce), f"{r.alternative} {_bytes(r.bytes_alternative)}",
                 _seconds(r.time_allreduce_s), _seconds(r.time_alternative_s), r.choice,
                 r.reason) for r in self.rows]
        widths = [max(len(str(row[i])) for row in [header] + body) for i in range(len(header))]
        for row in [header] + body:
            lines.append("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
        if any(r.batch_assumed for r in self.rows):
            lines.append(f"K? = batch dimension unknown at trace time; {ASSUMED_LOCAL_BATCH} "
                         "assumed.")
        lines.append("K: local batch (SFB) or rows looked up (sparse). Bytes per rank and "
                     "step (sent; as many received).")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _bytes(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _seconds(value: float) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"


class RatesCache:
    """The process's measured rates (measured at most once; every rank holds the same)."""

    def __init__(self):
        self.rates: cost_model.Rates | None = None


def agree(engine, candidates: Sequence[Candidate], config, num_replicas: int,
          cache: RatesCache) -> Plan:
    """Collective and blocking (every rank, same call sequence): the plan every rank uses.

    Raises RuntimeError on every rank if the ranks traced different layers.
    """
    element_bytes = config.codec.bytes_per_element
    local = [dataclasses.astuple(c) for c in candidates]

    def decide(comm):
        everyone = comm.allgather(local)
        layout = [[(c[0], c[1], c[2], c[5]) for c in rank_list] for rank_list in everyone]
        if any(other != layout[0] for other in layout[1:]):
            differing = next(r for r, other in enumerate(layout) if other != layout[0])
            raise RuntimeError(
                "tf_poseidon: ranks traced different layers (rank 0: "
                f"{layout[0]}, rank {differing}: {layout[differing]}); every rank must run "
                "the same model.")
        rows_by_rank = list(zip(*[[c[3] for c in rank_list] for rank_list in everyone]))
        merged = []
        for c, rows in zip(candidates, rows_by_rank):
            known = None if any(r is None for r in rows) else max(rows)
            merged.append((c, known))
        rates = cache.rates
        if rates is None and config.sfb == "auto" and any(
                c.protocol == SFB and c.refusal is None and cost_model.sfb_may_pay(
                    c.m, c.n, k or ASSUMED_LOCAL_BATCH, num_replicas) for c, k in merged):
            rates = cache.rates = cost_model.measure_rates(
                comm, getattr(config, "bandwidth_gbps", None))
        plan_rows = [_row(c, k, config.sfb, num_replicas, element_bytes, rates)
                     for c, k in merged]
        # Identical inputs give identical choices; rank 0's are used all the same.
        choices = comm.bcast([(r.choice, r.reason) for r in plan_rows], root=0)
        plan_rows = [dataclasses.replace(r, choice=c, reason=why)
                     for r, (c, why) in zip(plan_rows, choices)]
        return Plan(plan_rows, num_replicas, config.sfb, config.codec.name, rates)

    return engine.call(decide, label="per-layer plan")


def local_row(c: Candidate, num_replicas: int, element_bytes: float) -> LayerPlan:
    """The row of a candidate SFB cannot take (no rates, no agreement needed)."""
    return _row(c, c.rows, "never", num_replicas, element_bytes, None)


def _row(c: Candidate, k: int | None, mode: str, num_replicas: int, element_bytes: float,
         rates: cost_model.Rates | None) -> LayerPlan:
    """The plan row of ``c`` at largest-over-ranks K ``k``; ``mode`` is the sfb option."""
    if c.protocol == SPARSE:
        return _sparse_row(c, k, num_replicas, element_bytes, rates)
    nan = float("nan")
    if c.m is None or c.n is None:
        return LayerPlan(c.kernel, None, None, False, nan, nan, nan, nan, ALLREDUCE,
                         c.refusal or "not captured")
    if c.refusal is not None and k is None:  # e.g. a 3-D input: no meaningful K
        cost = cost_model.layer_cost(c.m, c.n, 0, num_replicas, element_bytes, rates)
        return LayerPlan(c.kernel, (c.m, c.n), None, False, cost.bytes_allreduce, nan,
                         nan, nan, ALLREDUCE, c.refusal)
    assumed = k is None
    k_used = ASSUMED_LOCAL_BATCH if assumed else k
    cost = cost_model.layer_cost(c.m, c.n, k_used, num_replicas, element_bytes, rates)
    row = LayerPlan(c.kernel, (c.m, c.n), k_used, assumed, cost.bytes_allreduce,
                    cost.bytes_sfb, cost.time_allreduce_s, cost.time_sfb_s, ALLREDUCE, "")
    if c.refusal is not None:
        return dataclasses.replace(row, reason=c.refusal)
    if mode == "never":
        return dataclasses.replace(row, reason="sfb='never'")
    if mode == "always":
        return dataclasses.replace(row, choice=SFB, reason="sfb='always'")
    if not cost_model.sfb_may_pay(c.m, c.n, k_used, num_replicas):
        return dataclasses.replace(row, reason="SFB moves more bytes: P·K·(M+N) ≥ 2·M·N")
    if rates is None:  # not reached: auto measures whenever SFB may pay
        return dataclasses.replace(row, reason="no rates")
    if cost.time_sfb_s < cost.time_allreduce_s:
        return dataclasses.replace(row, choice=SFB, reason=(
            f"SFB faster: est. {_seconds(cost.time_sfb_s)} < {_seconds(cost.time_allreduce_s)}"))
    return dataclasses.replace(row, reason=(
        f"all-reduce faster: est. {_seconds(cost.time_allreduce_s)} ≤ "
        f"{_seconds(cost.time_sfb_s)} (SFB pays latency + fixed overhead)"))


def _sparse_row(c: Candidate, k: int | None, num_replicas: int, element_bytes: float,
                rates: cost_model.Rates | None) -> LayerPlan:
    """Sparse rows against the dense all-reduce, by bytes (rows looked up: ``k``)."""
    if c.refusal is not None:
        nan = float("nan")
        return LayerPlan(c.kernel, None, k, False, nan, nan, nan, nan, ALLREDUCE, c.refusal,
                         SPARSE)
    assumed = k is None
    k_used = ASSUMED_LOCAL_BATCH * c.lookups_per_example if assumed else k
    cost = cost_model.sparse_cost(c.m, c.n, k_used, num_replicas, element_bytes, rates)
    sparse = cost.bytes_sparse < cost.bytes_allreduce
    reason = (f"sparse rows move fewer bytes: {_bytes(cost.bytes_sparse)} < "
              f"{_bytes(cost.bytes_allreduce)}" if sparse else
              "the dense all-reduce moves fewer bytes than every lookup's row")
    return LayerPlan(c.kernel, (c.m, c.n), k_used, assumed, cost.bytes_allreduce,
                     cost.bytes_sparse, cost.time_allreduce_s, cost.time_sparse_s,
                     SPARSE if sparse else ALLREDUCE, reason, SPARSE)


class Planner:
    """The sync algorithm's per-step question, answered once per traced layer set: for each
    gradient, its capture Match (sfb/capture.py) and agreed LayerPlan.

    Keeps the choices every rank agreed on ((kernel path, M, N) -> LayerPlan), the measured
    rates and the last plan (``strategy.plan()``) across retraces. Called on the tracing
    thread; the first trace that captured a new Dense layer runs :func:`agree` (a collective,
    blocking until every rank reaches it).
    """

    def __init__(self, engine, config, num_replicas: int):
        self._engine = engine
        self._config = config
        self._num_replicas = num_replicas
        self._agreed: dict[tuple, LayerPlan] = {}
        self._rates = RatesCache()
        self.plan: Plan | None = None

    def choose(self, session, grads, variables) -> list[tuple[object | None, LayerPlan | None]]:
        """Per gradient: (its capture Match or None, its agreed LayerPlan or None).

        A Dense kernel's gradient is matched against ``session``'s captured factors (None:
        sfb="never", or an eager call); an ``IndexedSlices`` gradient (an embedding's) is a
        sparse candidate whatever the session."""
        matches = [session.match(g, variables) if session is not None
                   and not isinstance(g, tf.IndexedSlices) else None for g in grads]
        candidates = [Candidate(m.kernel_name, m.m, m.n, m.rows, m.reason)
                      for m in matches if m is not None]
        sparse = {i: _sparse_candidate(g, v) for i, (g, v) in enumerate(zip(grads, variables))
                  if isinstance(g, tf.IndexedSlices)}
        seen = {c.kernel for c in candidates}
        skipped = [] if session is None else [
            Candidate(name, *(shape or (None, None)), None, reason)
            for name, (shape, reason) in session.skipped.items() if name not in seen]
        wanted = candidates + list(sparse.values())
        if any(c.refusal is None and _key(c) not in self._agreed for c in wanted):
            self.plan = agree(self._engine, wanted + skipped, self._config,
                              self._num_replicas, self._rates)
            self._agreed.update({_key(row): row for row in self.plan.rows})
        elif (candidates or skipped) and self.plan is None:
            # Nothing another protocol could take: a local plan, no collective.
            rows = [local_row(c, self._num_replicas, self._config.codec.bytes_per_element)
                    for c in candidates + skipped]
            self.plan = Plan(rows, self._num_replicas, self._config.sfb,
                             self._config.codec.name, self._rates.rates)
        chosen = []
        for i, m in enumerate(matches):
            if i in sparse:
                chosen.append((None, self._agreed.get(_key(sparse[i]))))
            else:
                chosen.append((m, self._agreed.get(_key(Candidate(
                    m.kernel_name, m.m, m.n, None, None))) if m is not None
                    and m.reason is None else None))
        return chosen


def _key(entry) -> tuple:
    """What identifies a plan row across retraces: (variable path, shape, protocol)."""
    if isinstance(entry, LayerPlan):
        return (entry.kernel, *(entry.shape or (None, None)), entry.alternative)
    return (entry.kernel, entry.m, entry.n, entry.protocol)


def _sparse_candidate(grad: tf.IndexedSlices, variable) -> Candidate:
    """The sparse candidate of an embedding table's gradient: (rows, width), the number of
    rows looked up this step (static, or None) and, for a dynamic batch, the rows looked up
    per example (the static inner dimensions of the ids the indices were flattened from)."""
    shape = variable.shape
    refusal = None if shape.rank == 2 and shape.is_fully_defined() else \
        f"table of shape {shape} (sparse rows need a static 2-D table)"
    rows, width = (int(shape[0]), int(shape[1])) if refusal is None else (None, None)
    lookups = grad.indices.shape[0]
    per_example = 1
    source = grad.indices
    if lookups is None and not tf.executing_eagerly() and source.op.type == "Reshape":
        inner = source.op.inputs[0].shape[1:]
        per_example = inner.num_elements() if inner.is_fully_defined() else 1
    return Candidate(variable.name.split(":")[0], rows, width,
                     int(lookups) if lookups is not None else None, refusal, SPARSE,
                     per_example)
