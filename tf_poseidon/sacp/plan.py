"""The per-layer plan: which protocol carries each gradient, agreed by every rank.

:class:`Planner` is what the sync algorithm asks, while it traces a train step, which protocol
carries each gradient: all-reduce, SFB for Dense kernels (sfb/), sparse rows for embeddings
(comm/sparse.py) or, with ``PoseidonStrategy(lowrank=...)``, a low-rank approximation for
matrix-shaped gradients (lowrank/). Per gradient it weighs every protocol that can carry it
(:func:`_row`: each one's bytes and estimated time, :class:`Estimate`). :func:`agree` is its
collective, called with what this rank traced: every rank sends its candidates (variable
names, shapes, local batch), the ranks check they traced the same layers, take the largest
local batch of each layer, measure the rates if the cost model needs them (once per process),
compute the choices from these identical inputs and finally all use rank 0's choices — so
every rank builds the same buckets and the collectives always match. :class:`Plan` is what
``strategy.plan()`` returns: the table, one row per gradient with a choice to make.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import tensorflow as tf

from tf_poseidon.lowrank import matrix_shape
from tf_poseidon.sacp import cost_model

ASSUMED_LOCAL_BATCH = 128
"""The local batch K the cost model assumes for a layer whose batch dimension is unknown when
the step is traced (a data set whose last batch is short). The choice depends on K only near
the layer's break-even batch, which for wide layers is far above this."""

SFB, SPARSE, ALLREDUCE, LOWRANK = "sfb", "sparse", "allreduce", "lowrank"
_LABELS = {ALLREDUCE: "all-reduce", SFB: "SFB", LOWRANK: "low-rank", SPARSE: "sparse rows"}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A gradient that another protocol than all-reduce might carry: a Dense kernel's (SFB;
    also a Dense layer skipped at capture), an embedding's sparse rows (``IndexedSlices``),
    or, with low-rank compression on, any matrix-shaped gradient.

    ``protocol`` is the structured alternative examined (SFB, SPARSE, or ALLREDUCE for none)
    and ``refusal`` why it cannot carry the gradient (None: it can). For SFB, (m, n) is the
    kernel's shape and ``rows`` the local batch K; for sparse, (m, n) is the table's (rows,
    width) and ``rows`` the number of rows looked up per step; otherwise (m, n) is the matrix
    the gradient is compressed as (lowrank.matrix_shape). ``lowrank``: whether low-rank
    compression is examined for it. ``rows_one_by_one`` (sparse): the optimizer applies an
    IndexedSlices gradient row by row in a way its dense sum would change, so only sparse
    rows give one process's update.
    """

    kernel: str  # variable path
    m: int | None
    n: int | None
    rows: int | None  # this rank's static K (or lookups), None if dynamic
    refusal: str | None  # why ``protocol`` cannot carry it, None if it can
    protocol: str = SFB
    lookups_per_example: int = 1  # sparse: rows looked up per example, for a dynamic batch
    lowrank: bool = False
    rows_one_by_one: bool = False  # sparse: the optimizer applies each row on its own


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One protocol's predicted cost for one gradient: bytes per rank and step (sent; as many
    are received) and seconds (NaN when no rates were measured or given). ``refusal`` says
    why the protocol cannot carry this gradient (it is shown, never chosen)."""

    protocol: str
    bytes: float
    time_s: float
    refusal: str | None = None


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One row of the plan: every protocol examined for a gradient (``estimates``,
    all-reduce first), the choice and why."""

    kernel: str
    shape: tuple[int, int] | None
    local_batch: int | None  # the K (or lookups) the estimate used (largest over ranks)
    batch_assumed: bool  # True when K was unknown at trace time and ASSUMED_LOCAL_BATCH used
    estimates: tuple[Estimate, ...]
    choice: str  # a protocol of ``estimates``
    reason: str

    def estimate(self, protocol: str) -> Estimate | None:
        """The estimate of ``protocol`` (None if it was not examined)."""
        return next((e for e in self.estimates if e.protocol == protocol), None)

    @property
    def protocols(self) -> tuple[str, ...]:
        return tuple(e.protocol for e in self.estimates)

    def as_dict(self) -> dict:
        """JSON-serialisable, each protocol's figures also as ``bytes_<protocol>`` and
        ``time_<protocol>_s`` (NaN becomes None)."""
        row = {"kernel": self.kernel, "shape": list(self.shape) if self.shape else None,
               "local_batch": self.local_batch, "batch_assumed": self.batch_assumed,
               "choice": self.choice, "reason": self.reason,
               "estimates": [dataclasses.asdict(e) for e in self.estimates]}
        for e in self.estimates:
            row[f"bytes_{e.protocol}"] = e.bytes
            row[f"time_{e.protocol}_s"] = e.time_s
        return _no_nan(row)


def _no_nan(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


@dataclasses.dataclass
class Plan:
    """What ``strategy.plan()`` returns: the per-layer choices of the last traced train step."""

    rows: list[LayerPlan]
    num_replicas: int
    sfb: str
    compression: str
    rates: cost_model.Rates | None = None
    note: str = ""
    lowrank: str | None = None  # the PowerSGD options, as written

    def choice(self, kernel: str) -> str | None:
        """The protocol chosen for the variable path ``kernel`` (None if unknown)."""
        return next((row.choice for row in self.rows if row.kernel == kernel), None)

    @property
    def sfb_kernels(self) -> list[str]:
        return [row.kernel for row in self.rows if row.choice == SFB]

    @property
    def lowrank_kernels(self) -> list[str]:
        return [row.kernel for row in self.rows if row.choice == LOWRANK]

    def as_dict(self) -> dict:
        """JSON-serialisable form (NaN times become None)."""
        return {"num_replicas": self.num_replicas, "sfb": self.sfb,
                "compression": self.compression, "lowrank": self.lowrank, "note": self.note,
                "rates": _no_nan(dataclasses.asdict(self.rates)) if self.rates else None,
                "rows": [r.as_dict() for r in self.rows]}

    def table(self) -> str:
        head = (f"Per-layer plan: P={self.num_replicas}, sfb={self.sfb!r}, "
                f"compression={self.compression!r}")
        if self.lowrank:
            head += f", lowrank={self.lowrank}"
        if self.rates is not None:
            head += f"; {self.rates.describe()}"
        lines = [head]
        if self.note:
            lines.append(self.note)
        if not self.rows:
            return "\n".join(lines)
        protocols = [p for p in _LABELS if any(p in r.protocols for r in self.rows)]
        header = ("layer (variable)", "shape", "K", *(_LABELS[p] for p in protocols),
                  "choice", "reason")
        body = []
        for r in self.rows:
            cells = []
            for protocol in protocols:
                e = r.estimate(protocol)
                cells.append("-" if e is None else
                             f"{_bytes(e.bytes)} {_seconds(e.time_s)}".strip()
                             + (" (no)" if e.refusal else ""))
            body.append((r.kernel, f"{r.shape[0]}x{r.shape[1]}" if r.shape else "?",
                         (f"{r.local_batch}?" if r.batch_assumed else str(r.local_batch))
                         if r.local_batch is not None else "-", *cells, r.choice, r.reason))
        widths = [max(len(str(row[i])) for row in [header] + body) for i in range(len(header))]
        for row in [header] + body:
            lines.append("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
        if any(r.batch_assumed for r in self.rows):
            lines.append(f"K? = batch dimension unknown at trace time; {ASSUMED_LOCAL_BATCH} "
                         "assumed.")
        lines.append("K: local batch (SFB) or rows looked up (sparse). Per protocol: bytes per "
                     "rank and step (sent; as many received) and estimated time; (no): it "
                     "cannot carry this gradient (the reason says why).")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _bytes(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _seconds(value: float) -> str:
    if value is None or math.isnan(value):
        return ""
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"


class RatesCache:
    """The process's measured rates (measured at most once; every rank holds the same)."""

    def __init__(self):
        self.rates: cost_model.Rates | None = None


def agree(engine, candidates: Sequence[Candidate], config, num_replicas: int,
          cache: RatesCache) -> Plan:
    """Collective and blocking (every rank, same call sequence): the plan every rank uses,
    one row per candidate, in order.

    Raises RuntimeError on every rank if the ranks traced different layers.
    """
    element_bytes = config.codec.bytes_per_element
    lowrank = config.lowrank
    local = [dataclasses.astuple(c) for c in candidates]

    def decide(comm):
        everyone = comm.allgather(local)
        layout = [[(c[0], c[1], c[2], c[5], c[7]) for c in rank_list] for rank_list in everyone]
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
        sfb_may_pay = config.sfb == "auto" and any(
            c.protocol == SFB and c.refusal is None and cost_model.sfb_may_pay(
                c.m, c.n, k or ASSUMED_LOCAL_BATCH, num_replicas) for c, k in merged)
        compressible = [] if lowrank is None else [
            (c.m, c.n) for c in candidates if c.lowrank and lowrank.refusal(c.m, c.n) is None]
        lowrank_may_pay = lowrank is not None and lowrank.choice == "auto" and bool(compressible)
        if rates is None and (sfb_may_pay or lowrank_may_pay):
            probe = cost_model.lowrank_probe_shape(compressible)
            rates = cache.rates = cost_model.measure_rates(
                comm, config.bandwidth_gbps,
                lowrank.matrix_rank(*probe) if lowrank is not None else None, probe)
        plan_rows = [_row(c, k, config.sfb, num_replicas, element_bytes, rates, lowrank)
                     for c, k in merged]
        # Identical inputs give identical choices; rank 0's are used all the same.
        choices = comm.bcast([(r.choice, r.reason) for r in plan_rows], root=0)
        plan_rows = [dataclasses.replace(r, choice=c, reason=why)
                     for r, (c, why) in zip(plan_rows, choices)]
        return Plan(plan_rows, num_replicas, config.sfb, config.codec.name, rates,
                    lowrank=repr(lowrank) if lowrank is not None else None)

    return engine.call(decide, label="per-layer plan")


def local_row(c: Candidate, num_replicas: int, element_bytes: float,
              lowrank=None) -> LayerPlan:
    """The row of a candidate no protocol but all-reduce can take (no rates, no agreement
    needed)."""
    return _row(c, c.rows, "never", num_replicas, element_bytes, None, lowrank)


def _row(c: Candidate, k: int | None, sfb: str, num_replicas: int, element_bytes: float,
         rates: cost_model.Rates | None, lowrank=None) -> LayerPlan:
    """The plan row of ``c`` at largest-over-ranks K ``k``: each protocol's estimate and the
    choice. ``sfb`` is the sfb option, ``lowrank`` the PowerSGD options (None: off)."""
    if c.protocol == SPARSE:
        return _sparse_row(c, k, num_replicas, element_bytes, rates)
    nan = float("nan")
    if c.m is None or c.n is None:
        return LayerPlan(c.kernel, None, None, False, (Estimate(ALLREDUCE, nan, nan),),
                         ALLREDUCE, c.refusal or "not captured")
    m, n, p = c.m, c.n, num_replicas
    # SFB's K, when the layer has a meaningful one (not, e.g., for a 3-D input).
    has_k = c.protocol == SFB and not (c.refusal is not None and k is None)
    assumed = has_k and k is None
    k_used = (ASSUMED_LOCAL_BATCH if assumed else k) if has_k else None
    bytes_ar = 2 * (p - 1) / p * m * n * element_bytes
    time_ar = cost_model.allreduce_time_s(m, n, k_used, p, element_bytes, rates)
    estimates = [Estimate(ALLREDUCE, bytes_ar, time_ar)]
    if c.protocol == SFB:
        if k_used is None:
            estimates.append(Estimate(SFB, nan, nan, c.refusal))
        else:
            cost = cost_model.layer_cost(m, n, k_used, p, element_bytes, rates)
            refusal = c.refusal or ("sfb='never'" if sfb == "never" else None)
            if refusal is None and sfb == "auto" and not cost_model.sfb_may_pay(m, n, k_used, p):
                refusal = "SFB moves more bytes: P·K·(M+N) ≥ 2·M·N"
            estimates.append(Estimate(SFB, cost.bytes_sfb, cost.time_sfb_s, refusal))
    if c.lowrank and lowrank is not None:
        cost = cost_model.lowrank_cost(m, n, lowrank.matrix_rank(m, n), k_used, p,
                                       element_bytes, rates)
        estimates.append(Estimate(LOWRANK, cost.bytes_lowrank, cost.time_lowrank_s,
                                  lowrank.refusal(m, n)))
    modes = {SFB: sfb, LOWRANK: lowrank.choice if lowrank is not None else None}
    choice, reason = _choose(estimates, modes)
    return LayerPlan(c.kernel, (m, n), k_used, assumed, tuple(estimates), choice, reason)


def _choose(estimates: Sequence[Estimate], modes: dict) -> tuple[str, str]:
    """(choice, reason) among ``estimates`` (all-reduce first): a protocol whose mode is
    "always" if any can carry the gradient (the one with the fewest bytes), else the lowest
    estimated time (all-reduce on a tie)."""
    allreduce, others = estimates[0], estimates[1:]
    options = [e for e in others if e.refusal is None]
    forced = [e for e in options if modes.get(e.protocol) == "always"]
    if forced:
        best = min(forced, key=lambda e: e.bytes)
        return best.protocol, ("sfb='always'" if best.protocol == SFB else
                               "PowerSGD choice='always'")
    if not options:
        return ALLREDUCE, "; ".join(e.refusal for e in others) or "all-reduce only"
    contenders = [allreduce, *options]
    if any(math.isnan(e.time_s) for e in contenders):  # not reached: auto measures rates
        return ALLREDUCE, "no rates"
    best = min(contenders, key=lambda e: e.time_s)
    return best.protocol, (
        f"{_LABELS[best.protocol]} fastest: est. {_seconds(best.time_s)} vs "
        + ", ".join(f"{_LABELS[e.protocol]} {_seconds(e.time_s)}"
                    for e in contenders if e is not best))


def _sparse_row(c: Candidate, k: int | None, num_replicas: int, element_bytes: float,
                rates: cost_model.Rates | None) -> LayerPlan:
    """Sparse rows against the dense all-reduce, by bytes (rows looked up: ``k``)."""
    if c.refusal is not None:
        nan = float("nan")
        return LayerPlan(c.kernel, None, k, False, (Estimate(ALLREDUCE, nan, nan),
                                                    Estimate(SPARSE, nan, nan, c.refusal)),
                         ALLREDUCE, c.refusal)
    assumed = k is None
    k_used = ASSUMED_LOCAL_BATCH * c.lookups_per_example if assumed else k
    cost = cost_model.sparse_cost(c.m, c.n, k_used, num_replicas, element_bytes, rates)
    sparse = c.rows_one_by_one or cost.bytes_sparse < cost.bytes_allreduce
    reason = ("the optimizer applies each looked-up row on its own (its update of the dense sum "
              "would differ from one process's)" if c.rows_one_by_one else
              f"sparse rows move fewer bytes: {_bytes(cost.bytes_sparse)} < "
              f"{_bytes(cost.bytes_allreduce)}" if sparse else
              "the dense all-reduce moves fewer bytes than every lookup's row")
    return LayerPlan(c.kernel, (c.m, c.n), k_used, assumed,
                     (Estimate(ALLREDUCE, cost.bytes_allreduce, cost.time_allreduce_s),
                      Estimate(SPARSE, cost.bytes_sparse, cost.time_sparse_s)),
                     SPARSE if sparse else ALLREDUCE, reason)


class Planner:
    """The sync algorithm's per-step question, answered once per traced layer set: for each
    gradient, its capture Match (sfb/capture.py) and agreed LayerPlan.

    Keeps the choices every rank agreed on (by :func:`_key` of the candidate), the measured
    rates and the last plan (``strategy.plan()``) across retraces. Called on the tracing
    thread; the first trace with a new gradient that another protocol than all-reduce could
    carry runs :func:`agree` (a collective, blocking until every rank reaches it).
    """

    def __init__(self, engine, config, num_replicas: int):
        self._engine = engine
        self._config = config
        self._num_replicas = num_replicas
        self._agreed: dict[tuple, LayerPlan] = {}
        self._rates = RatesCache()
        self.plan: Plan | None = None

    def choose(self, session, grads, variables, rows_one_by_one: bool = False
               ) -> list[tuple[object | None, LayerPlan | None]]:
        """Per gradient: (its capture Match or None, its agreed LayerPlan or None).

        A Dense kernel's gradient is matched against ``session``'s captured factors (None:
        sfb="never", or an eager call); an ``IndexedSlices`` gradient (an embedding's) is a
        sparse candidate whatever the session, always sent as sparse rows when
        ``rows_one_by_one`` (the optimizer applies each row on its own); with low-rank
        compression on, every other matrix-shaped floating gradient is a low-rank
        candidate."""
        lowrank = self._config.lowrank
        skipped = dict(session.skipped) if session is not None else {}
        matches, candidates = [], []
        for grad, variable in zip(grads, variables):
            if isinstance(grad, tf.IndexedSlices):
                matches.append(None)
                candidates.append(dataclasses.replace(_sparse_candidate(grad, variable),
                                                      rows_one_by_one=rows_one_by_one))
                continue
            match = session.match(grad, variables) if session is not None else None
            matches.append(match)
            shape = _lowrank_shape(variable) if lowrank is not None else None
            if match is not None:
                candidates.append(Candidate(match.kernel_name, match.m, match.n, match.rows,
                                            match.reason, lowrank=shape is not None))
            elif shape is not None:
                name = variable.name.split(":")[0]
                _, reason = skipped.pop(name, (None, None))
                candidates.append(Candidate(name, *shape, None, reason,
                                            SFB if reason else ALLREDUCE, lowrank=True))
            else:
                candidates.append(None)
        seen = {c.kernel for c in candidates if c is not None}
        shown = [Candidate(name, *(shape or (None, None)), None, reason)
                 for name, (shape, reason) in skipped.items() if name not in seen]
        wanted = [c for c in candidates if c is not None]
        if any(self._may_take(c) and _key(c) not in self._agreed for c in wanted):
            self.plan = agree(self._engine, wanted + shown, self._config,
                              self._num_replicas, self._rates)
            self._agreed.update({_key(c): row for c, row in zip(wanted + shown,
                                                                 self.plan.rows)})
        elif (wanted or shown) and self.plan is None:
            # Nothing another protocol could take: a local plan, no collective.
            rows = [local_row(c, self._num_replicas, self._config.codec.bytes_per_element,
                              lowrank) for c in wanted + shown]
            self.plan = Plan(rows, self._num_replicas, self._config.sfb,
                             self._config.codec.name, self._rates.rates,
                             lowrank=repr(lowrank) if lowrank is not None else None)
        return [(match, self._agreed.get(_key(c)) if c is not None else None)
                for match, c in zip(matches, candidates)]

    def _may_take(self, c: Candidate) -> bool:
        """Whether a protocol other than all-reduce may carry ``c`` (then the ranks agree)."""
        lowrank = self._config.lowrank
        return ((c.protocol in (SFB, SPARSE) and c.refusal is None)
                or (c.lowrank and lowrank.refusal(c.m, c.n) is None))


def _key(c: Candidate) -> tuple:
    """What identifies a plan row across retraces: (variable path, shape, protocols)."""
    return (c.kernel, c.m, c.n, c.protocol, c.lowrank, c.rows_one_by_one)


def _lowrank_shape(variable) -> tuple[int, int] | None:
    """The [m, n] a floating variable's gradient is compressed as (None: not a matrix, or
    float64, which the low-rank protocol does not carry)."""
    dtype = tf.as_dtype(variable.dtype)
    if not dtype.is_floating or dtype == tf.float64:
        return None
    return matrix_shape(variable.shape.as_list() if variable.shape.rank is not None else None)


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
