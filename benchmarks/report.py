"""The suite's configurations, and a run turned into tables, goals, the results block of
docs/benchmarks.md and its chart: pure functions of the run the suite saves as JSON
(``{"command", "started", "finished", "status", "settings", "environment", "emulation",
"results"}``), one result per (model, config, ranks, bandwidth) with ``status``, ``message``
and, when "ok", benchmarks.runner.aggregate's figures. docs/benchmarks.md defines the figures.
"""

import dataclasses
import os
import re

from benchmarks.models import MODELS

GOAL_VS_MWMS_FC, GOAL_VS_MWMS_CNN = 5.0, 2.0
GOAL_VS_ONE_PROCESS_2_HOSTS, GOAL_STEP_OVER_COMPUTE = 1.7, 1.2
BEGIN = "<!-- results: written by `python -m benchmarks.suite`; rerun it, do not edit by hand -->"
END = "<!-- end of results -->"


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration. ``kind``: single (one process, no strategy), concurrent (P processes,
    no communication), mwms (TF's MultiWorkerMirroredStrategy) or poseidon
    (``tp.PoseidonStrategy(**options)``, Keras fit); an option "<x>/P" is x over the ranks."""

    name: str
    label: str
    kind: str
    options: dict = dataclasses.field(default_factory=dict)

    def kwargs_for(self, ranks: int) -> dict:
        """The PoseidonStrategy keyword arguments for a job of ``ranks`` ranks."""
        return {k: float(v[:-2]) / ranks if isinstance(v, str) and v.endswith("/P") else v
                for k, v in self.options.items()}


FIXED, NO_SFB = {"autotune": False}, {"sfb": "never", "autotune": False}
CONFIGS = [
    Config("single", "one process, no distribution (compute-only reference)", "single"),
    Config("concurrent", "P independent processes, no communication", "concurrent"),
    Config("mwms", "TF MultiWorkerMirroredStrategy (RING, custom loop)", "mwms"),
    # The fixed settings (autotune=False); "auto" and "auto+fp16" are tuned in their first steps.
    Config("naive", "tf_poseidon sync, overlap=False, fp32 (naive)", "poseidon",
           {"overlap": False, **NO_SFB}),
    Config("dwbp", "tf_poseidon sync + DWBP (overlap=True)", "poseidon", NO_SFB),
    Config("fp16", "DWBP + compression='fp16'", "poseidon", {"compression": "fp16", **NO_SFB}),
    Config("sfb", "DWBP + sfb='auto'", "poseidon", FIXED),
    Config("fp16+sfb", "DWBP + compression='fp16' + sfb='auto'", "poseidon",
           {"compression": "fp16", **FIXED}),
    Config("auto", "PoseidonStrategy() defaults: sfb='auto', autotune=True (overlap tuned in "
           "the first steps)", "poseidon"),
    Config("auto+fp16", "compression='fp16', autotuned: overlap and fp16 or exact per bucket",
           "poseidon", {"compression": "fp16"}),
    # start_step=0: the few steps timed are the compressed steady state, not the warm-up.
    Config("powersgd", "DWBP + lowrank=PowerSGD(rank=4): all-reduce, SFB or low-rank per layer",
           "poseidon", {"lowrank": {"rank": 4, "start_step": 0}, **FIXED}),
    Config("powersgd-always", "DWBP + PowerSGD(rank=4, choice='always'): every matrix "
           "compressing >= 2x", "poseidon",
           {"lowrank": {"rank": 4, "start_step": 0, "choice": "always"}, **FIXED}),
    Config("ssp", "mode='ssp', staleness=2", "poseidon", {"mode": "ssp", "staleness": 2}),
    # alpha·P = 0.9: Zhang et al.'s beta, as the results were measured with.
    Config("easgd", "mode='easgd', tau=4, alpha=0.9/P", "poseidon",
           {"mode": "easgd", "tau": 4, "alpha": "0.9/P"}),
]
CONFIG_BY_NAME = {c.name: c for c in CONFIGS}
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bps": 8, "kbps": 8e3,
          "mbps": 8e6, "gbps": 8e9}


def rate_bits(rate: str | None) -> float | None:
    """Bits per second of a tc rate ("1gbit", "500mbit", "100mbps" = bytes/s); None for an
    unshaped link. Raises ValueError for anything else."""
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]+)", (rate or "").strip().lower())
    if rate is not None and not (m and m.group(2) in _UNITS):
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 1gbit, 10gbit, 500mbit)")
    return None if rate is None else float(m.group(1)) * _UNITS[m.group(2)]


def link_label(bandwidth: str | None, ranks: int) -> str:
    return "1 process" if ranks == 1 else f"{ranks} hosts × {bandwidth or 'unshaped'}"


def _title(model: str) -> str:
    return MODELS[model].title if model in MODELS else model


def _ok(r: dict | None) -> bool:
    return r is not None and r.get("status") == "ok" and bool(r.get("samples_per_s"))


def _vs(r: dict, base: dict | None) -> float | None:
    """``r``'s samples/s over ``base``'s where both succeeded, else None."""
    return r["samples_per_s"] / base["samples_per_s"] if _ok(r) and _ok(base) else None


def _place(model: str, ranks: int, bandwidth: str | None) -> tuple:
    """Table order: models.py's order, fewer ranks, slower links first."""
    return list(MODELS).index(model) if model in MODELS else 99, ranks, rate_bits(bandwidth) or 0


def find(results: list[dict], model: str, config: str, ranks: int | None = None,
         bandwidth: str | None = "*") -> dict | None:
    """The result for (model, config[, ranks, bandwidth]); ``bandwidth="*"`` matches any."""
    return next((r for r in results if r["model"] == model and r["config"] == config
                 and ranks in (None, r["ranks"]) and bandwidth in ("*", r["bandwidth"])), None)


def busiest(r: dict | None) -> float | None:
    """The bytes per timed step of the host that sent most (None: no counter)."""
    return max((b for b in (r or {}).get("tx_bytes_per_step") or [] if b is not None),
               default=None)


def derive(results: list[dict]) -> list[dict]:
    """Each result with ``compute_s`` (the one-process step), ``overhead`` (step ÷ compute_s),
    ``vs_mwms``, ``vs_one_process``, ``of_ceiling`` (samples/s ratios; the ceiling is the
    concurrent row: P processes without communication), ``wire_bytes_per_step`` (the busiest
    host's), ``floor_s`` (max(compute_s, wire bytes ÷ link rate)), ``kind`` (the
    configuration's) and ``notes``; sorted by model, ranks, bandwidth, configuration."""
    rows, order = [], list(CONFIG_BY_NAME)
    for r in results:
        single, where = find(results, r["model"], "single"), (r["ranks"], r["bandwidth"])
        kind = CONFIG_BY_NAME[r["config"]].kind if r["config"] in CONFIG_BY_NAME else ""
        distributed = kind in ("mwms", "poseidon")
        compute_s = single["step_s"] if _ok(single) else None
        wire, bits, ok = busiest(r), rate_bits(r["bandwidth"]), _ok(r)
        floor = [s for s in (compute_s, wire and bits and wire * 8 / bits) if s is not None]
        rows.append({
            **r, "compute_s": compute_s, "wire_bytes_per_step": wire, "kind": kind,
            "overhead": r["step_s"] / compute_s if ok and compute_s else None,
            "vs_mwms": _vs(r, find(results, r["model"], "mwms", *where)) if distributed else None,
            "vs_one_process": _vs(r, single), "of_ceiling": _vs(
                r, find(results, r["model"], "concurrent", *where)) if distributed else None,
            "floor_s": max(floor) if ok and floor else None, "notes": _notes(results, r, wire)})
    return sorted(rows, key=lambda r: (*_place(r["model"], r["ranks"], r["bandwidth"]),
                                       order.index(r["config"]) if r["config"] in order else 99))


def _failure(r: dict) -> str:
    text = f"{r['status']}: {r.get('message', '')}".strip().rstrip(":")
    if "signal 9" in text and "Error" not in text:
        text += (" (a SIGKILL with no Python error: on Linux usually the kernel's out-of-memory "
                 "killer, see dmesg)")
    return text


def _notes(results: list[dict], r: dict, wire: float | None) -> str:
    """Remarks: bytes against DWBP's, a step faster than the compute-only one, τ periods,
    tf_poseidon's own statistics; or the failure."""
    if r["status"] != "ok":
        return _failure(r)
    notes, dwbp = [], find(results, r["model"], "dwbp", r["ranks"], r["bandwidth"])
    base, single = busiest(dwbp) if _ok(dwbp) else None, find(results, r["model"], "single")
    if wire is not None and base and r["config"] in ("fp16", "sfb", "fp16+sfb"):
        notes.append(f"sends {wire / base:.0%} of DWBP's bytes"
                     + (": the option saved no traffic" if wire / base > 0.97 else ""))
    if r["ranks"] > 1 and _ok(single) and r["config"] != "concurrent" \
            and r["step_s"] < single["step_s"]:
        notes.append("faster than the compute-only step: load changed between the two "
                     "measurements")
    tau = CONFIG_BY_NAME[r["config"]].options.get("tau") if r["config"] in CONFIG_BY_NAME else 0
    if tau and r.get("steps") and r["steps"] % tau:
        notes.append(f"{r['steps']} timed steps are not whole periods of tau={tau}: wire "
                     "bytes and step time are not averaged over whole periods")
    sent, hidden = r.get("engine_bytes_per_step"), r.get("hidden_fraction")
    engine = ([] if sent is None else [f"{sent / 1e6:.1f} MB/step sent"]) + (
        [] if hidden is None else [f"{hidden:.0%} of comm. overlapped"])
    return "; ".join(notes + (["tf_poseidon stats: " + ", ".join(engine)] if engine else []))


def goals(rows: list[dict]) -> list[dict]:
    """Per (model, ranks > 1, bandwidth) of :func:`derive`'s rows: the best tf_poseidon
    configuration (most samples/s), its ratios against MWMS, one process, P processes without
    communication, the compute-only step and the floor, and per goal ``met_<ratio>``: True,
    False, or None (no figure or no goal)."""
    out = []
    for model, ranks, bw in sorted({(r["model"], r["ranks"], r["bandwidth"]) for r in rows
                                    if r["ranks"] > 1}, key=lambda c: _place(*c)):
        best = max((r for r in rows if (r["model"], r["ranks"], r["bandwidth"]) == (
            model, ranks, bw) and _ok(r) and r["kind"] == "poseidon"),
            key=lambda r: r["samples_per_s"], default={})
        g = {"model": model, "ranks": ranks, "bandwidth": bw, "best": best.get("config"),
             "best_samples_per_s": best.get("samples_per_s"), "vs_mwms": best.get("vs_mwms"),
             "goal_vs_mwms": GOAL_VS_MWMS_FC if model in MODELS and MODELS[model].fc_heavy
             else GOAL_VS_MWMS_CNN, "vs_one_process": best.get("vs_one_process"),
             "goal_vs_one_process": GOAL_VS_ONE_PROCESS_2_HOSTS if ranks == 2 else None,
             "overhead": best.get("overhead"), "goal_overhead": GOAL_STEP_OVER_COMPUTE,
             "over_floor": best["step_s"] / best["floor_s"] if best.get("floor_s") else None,
             "vs_concurrent": _vs(best, find(rows, model, "concurrent", ranks, bw))}
        for key, sense in (("vs_mwms", 1), ("vs_one_process", 1), ("overhead", -1)):
            value, goal = g[key], g[f"goal_{key}"]
            g[f"met_{key}"] = None if None in (value, goal) else sense * (value - goal) >= 0
        out.append(g)
    return out


def _num(value, fmt: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{fmt}}{suffix}"


def _goal(g: dict, key: str, sense: str) -> str:
    value, goal, met = g[key], g[f"goal_{key}"], g[f"met_{key}"]
    return "not measured" if value is None else f"{value:.2f}× " + (
        "(no goal)" if goal is None else f"(goal {sense} {goal:g}×: "
                                         f"{'met' if met else 'NOT met'})")


def result_table(rows: list[dict]) -> list[str]:
    """:func:`derive`'s rows as a table."""
    return table(["model", "hosts × link", "configuration", "samples/s", "step s",
                  "× compute", "× MWMS", "of ceiling", "wire MB/step", "floor s",
                  "peak MB/rank", "load", "notes"], [
        [_title(r["model"]), link_label(r["bandwidth"], r["ranks"]), r["config"],
         _num(r.get("samples_per_s"), ".1f"), _num(r.get("step_s"), ".3f"),
         _num(r["overhead"], ".2f", "×"), _num(r["vs_mwms"], ".2f", "×"),
         _num(r["of_ceiling"], ".2f"),
         _num(r["wire_bytes_per_step"] and r["wire_bytes_per_step"] / 1e6, ".1f"),
         _num(r["floor_s"], ".3f"), _num(r.get("peak_rss_bytes") and r["peak_rss_bytes"] / 1e6,
                                         ".0f"),
         _num(r.get("loadavg"), ".1f"), r["notes"]] for r in rows])


def profile_table(rows: list[dict]) -> list[str]:
    """The step profiles of :func:`derive`'s rows that have one (rank 0's; ms per step of
    each phase of tf_poseidon.profiling), or no lines."""
    from tf_poseidon.profiling import PHASES
    profiled = [r for r in rows if r.get("profile")]
    return table(["model", "hosts × link", "configuration", "step ms (profiled)",
                  *[f"{p} ms" for p in PHASES]], [
        [_title(r["model"]), link_label(r["bandwidth"], r["ranks"]), r["config"],
         _num(r["profile"]["step_s"] * 1e3, ".0f"),
         *[_num(r["profile"]["phases"].get(p, 0.0) * 1e3, ".0f") for p in PHASES]]
        for r in profiled]) if profiled else []


def goal_table(goal_rows: list[dict]) -> list[str]:
    """:func:`goals` as a table."""
    return table(["model", "hosts × link", "best tf_poseidon", "samples/s", "vs MWMS",
                  "vs one process", "vs P processes, no comm.", "step ÷ compute-only step",
                  "step ÷ floor"], [
        [_title(g["model"]), link_label(g["bandwidth"], g["ranks"]),
         g["best"] or "none measured", _num(g["best_samples_per_s"], ".1f"),
         _goal(g, "vs_mwms", "≥"), _goal(g, "vs_one_process", "≥"),
         _num(g["vs_concurrent"], ".2f", "×"), _goal(g, "overhead", "≤"),
         _num(g["over_floor"], ".2f", "×")] for g in goal_rows])


def table(head: list[str], body: list[list]) -> list[str]:
    """The lines of a markdown table (every benchmark's); cells shown by str(), ``|`` escaped."""
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"] + [
        "| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in body]


def markdown(run: dict) -> str:
    """The results block of docs/benchmarks.md for ``run``, from BEGIN to END."""
    rows, s, env = derive(run["results"]), run["settings"], run["environment"]
    status = {"running": "partial (the run was still going or was killed)",
              "interrupted": "partial (interrupted)"}.get(run.get("status"), run.get("status"))
    failed = [r for r in rows if r["status"] not in ("ok", "not available", "not run")]
    suspect = [g for g in goals(rows) if g["overhead"] is not None and g["overhead"] < 1.0]
    cores = str(env.get("cores", "")).split()[0] if env.get("cores") else ""
    busy = [r for r in rows if cores.isdigit() and (r.get("loadavg") or 0) > 2 * int(
        cores) + max(0, (r.get("ranks") or 1) - int(cores))]  # more ranks than cores load it
    return "\n".join([
        BEGIN, "", f"- Run: {run['started']} → {run.get('finished') or '…'}, **{status}**",
        "- Command (from the repository root, as root, venv active):", "", "  ```",
        f"  {run['command']}", "  ```", "", "![samples/s per configuration](benchmarks.png)", "",
        "## Results", "", f"Models: {', '.join(_title(m) for m in s['models'])}. Batch "
        f"{s['batch']} per rank, {s['warmup']} warm-up step(s) then {s['steps']} timed step(s) "
        "per configuration, 1 intra-op thread per rank, SGD, no metrics.", "",
        *result_table(rows), "",
        *([f"**Caution:** {len(busy)} of these figures were measured while the machine's "
           f"1-minute load average exceeded {2 * int(cores)} on its {cores} cores (plus one per "
           "rank beyond the cores): the cores were oversubscribed, by other jobs or by the "
           "ranks' own threads (see the load column). They understate what the "
           "configurations do with a core or more per rank, the compute-heavy CNNs most.", ""]
          if busy else []),
        *(["## Where the step time goes", "", "Rank 0's profile of steps after the timed "
           "ones (tf_poseidon.profiling.StepProfiler: ms per step; TensorFlow phases are op "
           "time summed over its threads, wire the engine thread's, engine queue the "
           "buckets' waits summed).", "",
           *profile_table(rows), ""] if profile_table(rows) else []),
        "## Goals", "", "Best tf_poseidon configuration at each number of hosts and link; "
        "targets: ≥ 5× MWMS on the FC-heavy model and ≥ 2× on the CNNs, 2 hosts ≥ 1.7× one "
        "process, step time ≤ 1.2× the compute-only step.", "", *goal_table(goals(rows)), "",
        *([f"**Not a verdict:** " + ", ".join(
            f"{_title(g['model'])} ({link_label(g['bandwidth'], g['ranks'])}, {g['best']})"
            for g in suspect) + ": the step was measured faster than the compute-only step, "
           "which no configuration can be (every rank computes every step): the machine's "
           "load changed between the two measurements, so do not trust these goal rows.", ""]
          if suspect else []),
        "## This run's set-up", "", f"- Emulation: {run['emulation']}",
        f"- Per-configuration timeout: {s['timeout']:g} s.", "", "| | |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in env.items()], "",
        *(["## Failures", ""] + [f"- {r['model']} {link_label(r['bandwidth'], r['ranks'])} "
                                 f"{r['config']}: {_failure(r)}" for r in failed] + [""]
          if failed else []), END]) + "\n"


def write_markdown(run: dict, path: str) -> None:
    """Replaces the results block of the document at ``path``, keeping the hand-written rest;
    a document without one is written with a title and the block."""
    text = open(path).read() if os.path.exists(path) else ""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not (begin and end):
        head, tail = "# Benchmarks: tf_poseidon vs MultiWorkerMirroredStrategy\n\n", "\n"
    with open(path + ".tmp", "w") as f:
        f.write(head + markdown(run).rstrip("\n") + tail)
    os.replace(path + ".tmp", path)


def chart(run: dict, path: str) -> None:
    """A PNG of samples/s: a panel per model, a bar per distributed configuration of the run
    grouped by hosts × link (0 and gray text if it did not run), one process dashed across the
    panel, P processes without communication dotted over their group. Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = derive(run["results"])
    models = [m for m in MODELS if any(r["model"] == m for r in rows)] or ["fc"]
    fig, axes = plt.subplots(len(models), 1, figsize=(12, 3.8 * len(models)), squeeze=False)
    names = [c.name for c in CONFIGS if c.kind in ("mwms", "poseidon")
             and any(r["config"] == c.name for r in rows)]
    width = 0.8 / max(1, len(names))  # none yet while only the one-process runs are done
    for ax, model in zip(axes[:, 0], models):
        mine = [r for r in rows if r["model"] == model]
        combos = sorted({(r["ranks"], r["bandwidth"]) for r in mine if r["ranks"] > 1},
                        key=lambda c: _place(model, *c))
        top = max([r["samples_per_s"] for r in mine if _ok(r)] or [1.0])
        for j, (ranks, bw) in enumerate(combos):
            for i, r in enumerate(find(mine, model, name, ranks, bw) for name in names):
                x, value = j + (i - (len(names) - 1) / 2) * width, _ok(r) and r["samples_per_s"]
                if r is not None:
                    ax.bar(x, value, width, color=f"C{i}", label=None if j else names[i])
                    ax.annotate(f"{value:.1f}" if value else r["status"], (x, value or top / 50),
                                ha="center", va="bottom", fontsize=6,
                                **({} if value else {"rotation": 90, "color": "gray"}))
            r = find(mine, model, "concurrent", ranks, bw)
            if _ok(r):
                ax.hlines(r["samples_per_s"], j - 0.45, j + 0.45, colors="black",
                          linestyles="dotted", label=None if j else "P processes, no comm.")
                ax.annotate(f"{r['samples_per_s']:.1f}", (j + 0.45, r["samples_per_s"]),
                            ha="left", va="center", fontsize=6)
        single = find(mine, model, "single")
        if _ok(single):
            ax.axhline(single["samples_per_s"], color="black", linestyle="--", linewidth=1,
                       label=f"one process ({single['samples_per_s']:.1f})")
        ax.set_xticks(range(len(combos)), [link_label(b, n) for n, b in combos])
        ax.set(xlim=(-0.6, max(1, len(combos)) - 0.4), ylabel="samples/s (all ranks)",
               title=_title(model))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("tf_poseidon vs MultiWorkerMirroredStrategy, emulated Ethernet, "
                 f"batch {run['settings']['batch']} per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
