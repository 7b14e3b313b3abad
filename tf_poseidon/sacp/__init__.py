"""SACP: structure-aware communication — which protocol carries each layer's gradient.

Poseidon's idea: the best way to synchronize a layer depends on its structure. Per layer, the
cost model weighs the protocols that can carry its gradient — all-reduce (every gradient),
sufficient factor broadcasting (Dense kernels; tf_poseidon/sfb/), low-rank approximation
(matrices, with ``lowrank=``; tf_poseidon/lowrank/) and sparse rows (embeddings) — by their
bytes on the wire and estimated time at the measured (or given) network and compute rates,
and the plan records the choice, agreed by every rank.

* ``cost_model.py`` — bytes and estimated times of each protocol, and the measured rates.
* ``plan.py`` — the per-layer choice (``Planner``), its collective agreement, and
  ``strategy.plan()``'s table.

Why this package and tf_poseidon/sfb/ are two: the plan is not part of SFB. It weighs every
protocol against every other (SFB is one candidate, as are all-reduce, sparse rows and
low-rank), so it lives here, once, and each protocol lives in its own place (sfb/,
comm/sparse.py, lowrank/, comm/protocol.py) with no knowledge of the others. A new protocol
adds its cost to ``cost_model.py`` and its candidacy to ``Planner.choose``.

docs/sfb.md and docs/compression.md have the details and figures.
"""

from __future__ import annotations

from tf_poseidon.sacp.plan import Plan


def plan_of(strategy) -> Plan:
    """The plan of ``strategy`` (see ``PoseidonStrategy.plan``); prints its table on rank 0."""
    from tf_poseidon import world
    extended = strategy.extended
    config = extended.config
    size = strategy.num_replicas_in_sync
    if size == 1:
        plan = Plan([], 1, config.sfb, config.compression,
                    note="A world of one process: nothing is communicated.",
                    lowrank=_lowrank(config))
    else:
        impl = extended.algorithm_impl_if_built
        plan = impl.plan() if impl is not None else None
        if plan is None:
            if config.sfb == "never" and config.lowrank is None:
                why = "sfb='never': every gradient is all-reduced."
            elif impl is not None and not config.algorithm.plans:
                why = f"mode={config.mode!r} does not plan protocols per layer."
            else:
                why = ("No train step with a gradient another protocol could carry has been "
                       "traced yet: the plan is made when it is (the first fit step or "
                       "strategy.run).")
            plan = Plan([], size, config.sfb, config.compression, note=why,
                        lowrank=_lowrank(config))
    if world.is_chief():
        print(plan.table(), flush=True)
    return plan


def _lowrank(config) -> str | None:
    return repr(config.lowrank) if config.lowrank is not None else None
