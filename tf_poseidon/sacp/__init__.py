"""SACP: structure-aware communication — sufficient factor broadcasting (SFB) for Dense layers.

For a Dense kernel W (M×N) and local batch K, the gradient is ΔW_p = x_pᵀδ_p; instead of
all-reducing M·N numbers, the ranks can all-gather the factors (K·(M+N) numbers each) and
rebuild ΣΔW_p = UᵀV. Where that pays is the cost model's call, per layer.

* ``capture.py`` — while the replica function is traced, Dense layers record (x, δ) against the
  local kernel gradient they return; no change to the user's model.
* ``cost_model.py`` — bytes and estimated times of both ways, with measured or given rates.
* ``plan.py`` — the per-layer choice, agreed by every rank; ``strategy.plan()``'s table.

The SFB collective itself (buckets, wire format, reconstruction) is comm/sfb.py; the sync
synchronizer (sync/bsp.py) puts the pieces together. docs/sfb.md has the details and figures.
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
                    note="A world of one process: nothing is communicated.")
    else:
        synchronizer = extended._synchronizer  # not the property: that would start MPI
        plan = getattr(synchronizer, "sfb_plan", None)
        if plan is None:
            why = ("sfb='never': every gradient is all-reduced." if config.sfb == "never"
                   else "No train step with Dense layers has been traced yet: the plan is "
                        "made when it is (the first fit step or strategy.run).")
            if synchronizer is not None and not hasattr(synchronizer, "sfb_plan"):
                why = f"mode={config.mode!r} does not use SFB."
            plan = Plan([], size, config.sfb, config.compression, note=why)
    if world.is_chief():
        print(plan.table(), flush=True)
    return plan
