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

from tf_poseidon.sacp import cost_model

ASSUMED_LOCAL_BATCH = 128
"""The local batch K the cost model assumes for a layer whose batch dimension is unknown when
the step is traced (a data set whose last batch is short). The choice depends on K only near
the layer's break-even batch, which for wide layers is far above this."""

SFB, ALLREDUCE = "sfb", "allreduce"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A Dense kernel gradient seen at the reduction (or a Dense layer skipped at capture)."""

    kernel: str  # variable path
    m: int | None
    n: int | None
    rows: int | None  # this rank's static local batch, None if dynamic
    refusal: str | None  # why SFB cannot reduce it, None if it can


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One row of the plan. Bytes are per rank and step, sent (as many are received)."""

    kernel: str
    shape: tuple[int, int] | None
    local_batch: int | None  # the K the estimate used (largest over ranks)
    batch_assumed: bool  # True when K was unknown at trace time and ASSUMED_LOCAL_BATCH used
    bytes_allreduce: float
    bytes_sfb: float
    time_allreduce_s: float  # NaN when no rates were measured or given
    time_sfb_s: float
    choice: str  # "sfb" or "allreduce"
    reason: str


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
        """"sfb" or "allreduce" for the kernel variable path ``kernel`` (None if unknown)."""
        return next((row.choice for row in self.rows if row.kernel == kernel), None)

    @property
    def sfb_kernels(self) -> list[str]:
        return [row.kernel for row in self.rows if row.choice == SFB]

    def as_dict(self) -> dict:
        """JSON-serialisable form (NaN times become None)."""
        def clean(value):
            return None if isinstance(value, float) and math.isnan(value) else value
        return {"num_replicas": self.num_replicas, "sfb": self.sfb,
                "compression": self.compression, "note": self.note,
                "rates": dataclasses.asdict(self.rates) if self.rates else None,
                "rows": [{k: clean(v) for k, v in dataclasses.asdict(r).items()}
                         for r in self.rows]}

    def table(self) -> str:
        head = (f"SFB plan: P={self.num_replicas}, sfb={self.sfb!r}, "
                f"compression={self.compression!r}")
        if self.rates is not None:
            head += f"; {self.rates.describe()}"
        lines = [head]
        if self.note:
            lines.append(self.note)
        if not self.rows:
            return "\n".join(lines)
        header = ("layer (kernel)", "shape", "K", "all-reduce", "SFB", "t all-reduce",
                  "t SFB", "choice", "reason")
        body = [(r.kernel, f"{r.shape[0]}x{r.shape[1]}" if r.shape else "?",
                 (f"{r.local_batch}?" if r.batch_assumed else str(r.local_batch))
                 if r.local_batch is not None else "-",
                 _bytes(r.bytes_allreduce), _bytes(r.bytes_sfb), _seconds(r.time_allreduce_s),
                 _seconds(r.time_sfb_s), r.choice, r.reason) for r in self.rows]
        widths = [max(len(str(row[i])) for row in [header] + body) for i in range(len(header))]
        for row in [header] + body:
            lines.append("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
        if any(r.batch_assumed for r in self.rows):
            lines.append(f"K? = batch dimension unknown at trace time; {ASSUMED_LOCAL_BATCH} "
                         "assumed. Bytes per rank and step (sent; as many received).")
        else:
            lines.append("Bytes per rank and step (sent; as many received).")
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

    Raises RuntimeError on every rank if the ranks traced different Dense layers.
    """
    element_bytes = config.codec.bytes_per_element
    local = [dataclasses.astuple(c) for c in candidates]

    def decide(comm):
        everyone = comm.allgather(local)
        layout = [[(c[0], c[1], c[2]) for c in rank_list] for rank_list in everyone]
        if any(other != layout[0] for other in layout[1:]):
            differing = next(r for r, other in enumerate(layout) if other != layout[0])
            raise RuntimeError(
                "tf_poseidon SFB: ranks traced different Dense layers (rank 0: "
                f"{layout[0]}, rank {differing}: {layout[differing]}); every rank must run "
                "the same model.")
        rows_by_rank = list(zip(*[[c[3] for c in rank_list] for rank_list in everyone]))
        merged = []
        for c, rows in zip(candidates, rows_by_rank):
            known = None if any(r is None for r in rows) else max(rows)
            merged.append((c, known))
        rates = cache.rates
        if rates is None and config.sfb == "auto" and any(
                c.refusal is None and cost_model.sfb_may_pay(
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

    return engine.call(decide)


def local_row(c: Candidate, num_replicas: int, element_bytes: float) -> LayerPlan:
    """The row of a candidate SFB cannot take (no rates, no agreement needed)."""
    return _row(c, c.rows, "never", num_replicas, element_bytes, None)


def _row(c: Candidate, k: int | None, mode: str, num_replicas: int, element_bytes: float,
         rates: cost_model.Rates | None) -> LayerPlan:
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
        """Per gradient: (its capture Match or None, its agreed LayerPlan or None). With no
        capture session (sfb="never", or an eager call) every gradient is (None, None)."""
        if session is None:
            return [(None, None)] * len(grads)
        matches = [session.match(g, variables) for g in grads]
        candidates = [Candidate(m.kernel_name, m.m, m.n, m.rows, m.reason)
                      for m in matches if m is not None]
        seen = {c.kernel for c in candidates}
        skipped = [Candidate(name, *(shape or (None, None)), None, reason)
                   for name, (shape, reason) in session.skipped.items() if name not in seen]
        if any(c.refusal is None and (c.kernel, c.m, c.n) not in self._agreed
               for c in candidates):
            self.plan = agree(self._engine, candidates + skipped, self._config,
                              self._num_replicas, self._rates)
            self._agreed.update({(row.kernel, *(row.shape or (None, None))): row
                                 for row in self.plan.rows})
        elif (candidates or skipped) and self.plan is None:
            # Nothing SFB could take: a local plan, no collective.
            rows = [local_row(c, self._num_replicas, self._config.codec.bytes_per_element)
                    for c in candidates + skipped]
            self.plan = Plan(rows, self._num_replicas, self._config.sfb,
                             self._config.codec.name, self._rates.rates)
        return [(m, self._agreed.get((m.kernel_name, m.m, m.n))
                 if m is not None and m.reason is None else None) for m in matches]
