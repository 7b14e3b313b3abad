"""The suite's configurations, and a run (the JSON the suite writes) turned into tables, goals,
the results block of docs/benchmarks.md and a chart.

Pure functions of the run dict, so a report is rebuilt from a saved run
(``python -m benchmarks.suite --report-only docs/benchmarks/results.json``). The run dict::

    {"command": str, "started": iso, "finished": iso | None, "status": "running" | "complete"
     | "interrupted", "settings": {...}, "environment": {...}, "emulation": str,
     "results": [result, ...]}

and one ``result`` per measured (model, configuration, ranks, bandwidth)::

    {"model", "config", "ranks", "bandwidth" (tc rate or None), "status": "ok" | "not
     available" | "failed" | "timed out" | "interrupted" | "not run", "message", "wall_s",
     and when ok benchmarks.runner.aggregate's figures: "samples_per_s", "step_s", ...}

The definitions of the derived figures are in docs/benchmarks.md ("How the figures are
measured"), next to the results block this module writes.
"""

from __future__ import annotations

import dataclasses
import os
import re

from benchmarks.models import MODELS

# Goals (measured at 2 emulated hosts, 1 Gbit/s, batch 32 per rank).
GOAL_VS_MWMS_FC = 5.0
GOAL_VS_MWMS_CNN = 2.0
GOAL_VS_ONE_PROCESS_2_HOSTS = 1.7
GOAL_STEP_OVER_COMPUTE = 1.2
BEGIN = "<!-- results: written by `python -m benchmarks.suite`; rerun it, do not edit by hand -->"
END = "<!-- end of results -->"


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark configuration. ``kind``: single (one process, no strategy), concurrent
    (P independent processes, no communication), mwms (TF's MultiWorkerMirroredStrategy), or
    poseidon (``tp.PoseidonStrategy(**options)`` with Keras fit)."""

    name: str
    label: str
    kind: str
    options: tuple[tuple[str, object], ...] = ()

    @property
    def kwargs(self) -> dict:
        """The options as written; a value "<x>/P" stands for x divided by the ranks."""
        return dict(self.options)

    def kwargs_for(self, ranks: int) -> dict:
        """The PoseidonStrategy keyword arguments for a job of ``ranks`` ranks."""
        return {k: float(v[:-2]) / ranks if isinstance(v, str) and v.endswith("/P") else v
                for k, v in self.options}

    @property
    def is_poseidon(self) -> bool:
        return self.kind == "poseidon"


CONFIGS: list[Config] = [
    Config("single", "one process, no distribution (compute-only reference)", "single"),
    Config("concurrent", "P independent processes, no communication", "concurrent"),
    Config("mwms", "TF MultiWorkerMirroredStrategy (RING, custom loop)", "mwms"),
    Config("naive", "tf_poseidon sync, overlap=False, fp32 (naive)", "poseidon",
           (("overlap", False), ("sfb", "never"))),
    Config("dwbp", "tf_poseidon sync + DWBP (overlap=True)", "poseidon", (("sfb", "never"),)),
    Config("fp16", "DWBP + compression='fp16'", "poseidon",
           (("compression", "fp16"), ("sfb", "never"))),
    Config("sfb", "DWBP + sfb='auto' (PoseidonStrategy() defaults)", "poseidon", ()),
    Config("fp16+sfb", "DWBP + compression='fp16' + sfb='auto'", "poseidon",
           (("compression", "fp16"),)),
    Config("ssp", "mode='ssp', staleness=2", "poseidon", (("mode", "ssp"), ("staleness", 2))),
    # alpha = 0.9/P: Zhang et al.'s beta = alpha·P = 0.9, as the results were measured with.
    Config("easgd", "mode='easgd', tau=4, alpha=0.9/P", "poseidon",
           (("mode", "easgd"), ("tau", 4), ("alpha", "0.9/P"))),
]
CONFIG_BY_NAME = {c.name: c for c in CONFIGS}
_ORDER = {c.name: i for i, c in enumerate(CONFIGS)}
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 2**10, "mibit": 2**20, "gibit": 2**30,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def rate_bits(rate: str | None) -> float | None:
    """Bits per second of a tc rate ("1gbit", "10gbit", "500mbit", "100mbps" = bytes/s);
    None for an unshaped link. Raises ValueError for anything else."""
    if rate is None:
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]+)", rate.strip().lower())
    if not m or m.group(2) not in _RATE_UNITS:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 1gbit, 10gbit, 500mbit)")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def link_label(bandwidth: str | None, ranks: int) -> str:
    return "1 process" if ranks == 1 else f"{ranks} hosts × {bandwidth or 'unshaped'}"


def _title(model: str) -> str:
    return MODELS[model].title if model in MODELS else model


def _kind(config: str) -> str:
    return CONFIG_BY_NAME[config].kind if config in CONFIG_BY_NAME else ""


# -- derived figures -------------------------------------------------------------------------


def _ok(r: dict | None) -> bool:
    return r is not None and r.get("status") == "ok" and bool(r.get("samples_per_s"))


def find(results: list[dict], model: str, config: str, ranks: int | None = None,
         bandwidth: str | None = "*") -> dict | None:
    """The result for (model, config[, ranks, bandwidth]); ``bandwidth="*"`` matches any."""
    return next((r for r in results if r["model"] == model and r["config"] == config
                 and ranks in (None, r["ranks"]) and bandwidth in ("*", r["bandwidth"])), None)


def _busiest(r: dict | None) -> float | None:
    tx = [b for b in (r or {}).get("tx_bytes_per_step") or [] if b is not None]
    return max(tx) if tx else None


def derive(results: list[dict]) -> list[dict]:
    """Each result with the figures that need other results: ``compute_s``, ``overhead``,
    ``vs_mwms``, ``vs_one_process``, ``wire_bytes_per_step`` (busiest host's sent bytes),
    ``floor_s``, ``notes``. Sorted by model, ranks, bandwidth, configuration order."""
    rows = []
    for r in results:
        single = find(results, r["model"], "single")
        mwms = find(results, r["model"], "mwms", r["ranks"], r["bandwidth"])
        compute_s = single["step_s"] if _ok(single) else None
        wire, bits = _busiest(r), rate_bits(r["bandwidth"])
        floor = max((p for p in (compute_s, wire * 8 / bits if wire is not None and bits
                                 else None) if p is not None), default=None)
        ok = _ok(r)
        rows.append({
            **r, "compute_s": compute_s, "wire_bytes_per_step": wire,
            "overhead": r["step_s"] / compute_s if ok and compute_s else None,
            "vs_mwms": (r["samples_per_s"] / mwms["samples_per_s"]
                        if _kind(r["config"]) in ("mwms", "poseidon") and ok and _ok(mwms)
                        else None),
            "vs_one_process": r["samples_per_s"] / single["samples_per_s"]
            if ok and _ok(single) else None,
            "floor_s": floor if ok else None, "notes": _notes(results, r, wire)})
    model_order = {m: i for i, m in enumerate(MODELS)}
    rows.sort(key=lambda r: (model_order.get(r["model"], 99), r["ranks"],
                             rate_bits(r["bandwidth"]) or 0, _ORDER.get(r["config"], 99)))
    return rows


def _failure(r: dict) -> str:
    """What a configuration that did not complete reports: its status and message."""
    text = f"{r['status']}: {r.get('message', '')}".strip().rstrip(":")
    if "signal 9" in text and "Error" not in text:
        text += (" (a SIGKILL with no Python error: on Linux usually the kernel's out-of-memory "
                 "killer, see dmesg)")
    return text


def _notes(results: list[dict], r: dict, wire: float | None) -> str:
    """Automatic remarks: bytes saved against DWBP, suspicious timings, failures."""
    if r["status"] != "ok":
        return _failure(r)
    notes = []
    baseline = find(results, r["model"], "dwbp", r["ranks"], r["bandwidth"])
    base = _busiest(baseline) if _ok(baseline) else None
    if wire is not None and base and r["config"] in ("fp16", "sfb", "fp16+sfb"):
        ratio = wire / base
        notes.append(f"sends {ratio:.0%} of DWBP's bytes"
                     + (": the option saved no traffic" if ratio > 0.97 else ""))
    single = find(results, r["model"], "single")
    if (r["ranks"] > 1 and _ok(single) and r["config"] != "concurrent"
            and r["step_s"] < single["step_s"]):
        notes.append("faster than the compute-only step: load changed between the two "
                     "measurements")
    tau = CONFIG_BY_NAME[r["config"]].kwargs.get("tau") if r["config"] in CONFIG_BY_NAME else 0
    if tau and r.get("steps") and r["steps"] % tau:
        notes.append(f"{r['steps']} timed steps are not whole periods of tau={tau}: wire "
                     "bytes and step time are not averaged over whole periods")
    engine = []
    if r.get("engine_bytes_per_step") is not None:
        engine.append(f"{r['engine_bytes_per_step'] / 1e6:.1f} MB/step sent")
    if r.get("hidden_fraction") is not None:
        engine.append(f"{r['hidden_fraction']:.0%} of comm. overlapped")
    if engine:
        notes.append("tf_poseidon stats: " + ", ".join(engine))
    return "; ".join(notes)


def goals(rows: list[dict]) -> list[dict]:
    """One goal row per measured (model, ranks > 1, bandwidth): the best tf_poseidon
    configuration (most samples/s) and its ratios against MWMS, one process, P processes
    without communication and the compute-only step, each with its goal and whether it is met
    (True/False; None = no goal or no figure)."""
    out = []
    combos = sorted({(r["model"], r["ranks"], r["bandwidth"]) for r in rows if r["ranks"] > 1},
                    key=lambda c: (list(MODELS).index(c[0]) if c[0] in MODELS else 99, c[1],
                                   rate_bits(c[2]) or 0))
    for model, ranks, bandwidth in combos:
        best = max((r for r in rows if (r["model"], r["ranks"], r["bandwidth"]) ==
                    (model, ranks, bandwidth) and _ok(r) and _kind(r["config"]) == "poseidon"),
                   key=lambda r: r["samples_per_s"], default=None)
        fc = model in MODELS and MODELS[model].fc_heavy
        goal_mwms = GOAL_VS_MWMS_FC if fc else GOAL_VS_MWMS_CNN
        goal_one = GOAL_VS_ONE_PROCESS_2_HOSTS if ranks == 2 else None
        concurrent = find(rows, model, "concurrent", ranks, bandwidth)
        g = {"model": model, "ranks": ranks, "bandwidth": bandwidth,
             "best": best and best["config"], "best_samples_per_s": best and best["samples_per_s"],
             "vs_mwms": best and best["vs_mwms"], "goal_vs_mwms": goal_mwms,
             "vs_one_process": best and best["vs_one_process"], "goal_vs_one_process": goal_one,
             "overhead": best and best["overhead"], "goal_overhead": GOAL_STEP_OVER_COMPUTE,
             "over_floor": best["step_s"] / best["floor_s"] if best and best["floor_s"] else None,
             "vs_concurrent": best["samples_per_s"] / concurrent["samples_per_s"]
             if best and _ok(concurrent) else None}
        g["met_vs_mwms"] = None if g["vs_mwms"] is None else g["vs_mwms"] >= goal_mwms
        g["met_vs_one_process"] = (None if g["vs_one_process"] is None or goal_one is None
                                   else g["vs_one_process"] >= goal_one)
        g["met_overhead"] = (None if g["overhead"] is None
                             else g["overhead"] <= GOAL_STEP_OVER_COMPUTE)
        out.append(g)
    return out


# -- formatting ------------------------------------------------------------------------------


def _num(value, fmt: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{fmt}}{suffix}"


def _goal_cell(value, goal, met, sense: str) -> str:
    if value is None:
        return "not measured"
    if goal is None:
        return f"{value:.2f}× (no goal)"
    return f"{value:.2f}× (goal {sense} {goal:g}×: {'met' if met else 'NOT met'})"


def result_table(rows: list[dict], markdown: bool = True) -> list[str]:
    """The results as table lines (markdown, or aligned plain text for the console)."""
    head = ["model", "hosts × link", "configuration", "samples/s", "step s", "× compute",
            "× MWMS", "wire MB/step", "floor s", "load", "notes"]
    wire = lambda r: None if r["wire_bytes_per_step"] is None else r["wire_bytes_per_step"] / 1e6
    body = [[_title(r["model"]), link_label(r["bandwidth"], r["ranks"]), r["config"],
             _num(r.get("samples_per_s"), ".1f"), _num(r.get("step_s"), ".3f"),
             _num(r["overhead"], ".2f", "×"), _num(r["vs_mwms"], ".2f", "×"),
             _num(wire(r), ".1f"), _num(r["floor_s"], ".3f"), _num(r.get("loadavg"), ".1f"),
             r["notes"]] for r in rows]
    return _table(head, body, markdown)


def goal_table(goal_rows: list[dict], markdown: bool = True) -> list[str]:
    head = ["model", "hosts × link", "best tf_poseidon", "samples/s", "vs MWMS",
            "vs one process", "vs P processes, no comm.", "step ÷ compute-only step",
            "step ÷ floor"]
    body = [[_title(g["model"]), link_label(g["bandwidth"], g["ranks"]),
             g["best"] or "none measured", _num(g["best_samples_per_s"], ".1f"),
             _goal_cell(g["vs_mwms"], g["goal_vs_mwms"], g["met_vs_mwms"], "≥"),
             _goal_cell(g["vs_one_process"], g["goal_vs_one_process"],
                        g["met_vs_one_process"], "≥"),
             _num(g["vs_concurrent"], ".2f", "×"),
             _goal_cell(g["overhead"], g["goal_overhead"], g["met_overhead"], "≤"),
             _num(g["over_floor"], ".2f", "×")] for g in goal_rows]
    return _table(head, body, markdown)


def _table(head: list[str], body: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        cells = [[c.replace("|", "\\|") for c in row] for row in body]
        return (["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
                + ["| " + " | ".join(row) + " |" for row in cells])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
    return [fmt(head), fmt(["-" * w for w in widths])] + [fmt(row) for row in body]


# -- the document and the chart ---------------------------------------------------------------


def markdown(run: dict) -> str:
    """The results block of docs/benchmarks.md for ``run``, between the BEGIN and END
    markers (the rest of the document is written by hand)."""
    rows = derive(run["results"])
    s, env = run["settings"], run["environment"]
    status = {"running": "partial (the run was still going or was killed)",
              "interrupted": "partial (interrupted)"}.get(run.get("status"), run.get("status"))
    failed = [r for r in rows if r["status"] not in ("ok", "not available", "not run")]
    lines = [
        BEGIN, "",
        f"- Run: {run['started']} → {run.get('finished') or '…'}, **{status}**",
        "- Command (from the repository root, as root, venv active):", "", "  ```",
        f"  {run['command']}", "  ```", "",
        "![samples/s per configuration](benchmarks.png)", "", "## Results", "",
        f"Models: {', '.join(_title(m) for m in s['models'])}. Batch {s['batch']} per rank, "
        f"{s['warmup']} warm-up step(s) then {s['steps']} timed step(s) per configuration, "
        "1 intra-op thread per rank, SGD, no metrics.", "",
        *result_table(rows), "", *_load_warning(rows, env),
        "## Goals", "",
        "Best tf_poseidon configuration at each number of hosts and link; goals: ≥ 5× MWMS "
        "on the FC-heavy model and ≥ 2× on the CNNs, 2 hosts ≥ 1.7× one process, step time "
        "≤ 1.2× the compute-only step.", "",
        *goal_table(goals(rows)), "", *_goal_caveats(rows),
        "## This run's set-up", "",
        f"- Emulation: {run['emulation']}",
        f"- Per-configuration timeout: {s['timeout']:g} s.", "",
        "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in env.items()], "",
        *(["## Failures", ""] + [f"- {r['model']} {link_label(r['bandwidth'], r['ranks'])} "
                                 f"{r['config']}: {_failure(r)}" for r in failed] + [""]
          if failed else []),
        END]
    return "\n".join(lines) + "\n"


def write_markdown(run: dict, path: str) -> None:
    """Replaces the results block of the document at ``path`` (its hand-written rest is
    kept); a document without one gets a title and the block."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not (begin and end):
        head, tail = "# Benchmarks: tf_poseidon vs MultiWorkerMirroredStrategy\n\n", "\n"
    with open(path + ".tmp", "w") as f:
        f.write(head + markdown(run).rstrip("\n") + tail)
    os.replace(path + ".tmp", path)


def _goal_caveats(rows: list[dict]) -> list[str]:
    """A paragraph naming goal verdicts that rest on a step faster than the compute-only
    step, which no configuration can really be (every rank computes every step)."""
    suspect = [g for g in goals(rows) if g["overhead"] is not None and g["overhead"] < 1.0]
    if not suspect:
        return []
    names = ", ".join(f"{_title(g['model'])} ({link_label(g['bandwidth'], g['ranks'])}, "
                      f"{g['best']})" for g in suspect)
    return [f"**Not a verdict:** {names}: the step was measured faster than the compute-only "
            "step, which no configuration can be (every rank computes every step): the "
            "machine's load changed between the two measurements, so do not trust "
            f"{'this goal row' if len(suspect) == 1 else 'these goal rows'}.", ""]


def _load_warning(rows: list[dict], env: dict) -> list[str]:
    """A warning paragraph if some figures were measured on an oversubscribed machine."""
    try:
        cores = int(str(env.get("cores", "")).split()[0])
    except (ValueError, IndexError):
        return []
    # A job of more ranks than cores loads the machine by itself: one more per extra rank.
    busy = [r for r in rows
            if (r.get("loadavg") or 0) > 2 * cores + max(0, (r.get("ranks") or 1) - cores)]
    if not busy:
        return []
    return [f"**Caution:** {len(busy)} of these figures were measured while the machine's "
            f"1-minute load average exceeded {2 * cores} on its {cores} cores (plus one per "
            "rank beyond the cores): the cores were oversubscribed, by other jobs or by the "
            "ranks' own threads (see the load column). They understate what the "
            "configurations do with a core or more per rank, the compute-heavy CNNs most.", ""]


def chart(run: dict, path: str) -> None:
    """A PNG of samples/s per configuration: one panel per model, bars grouped by
    hosts × link; the one-process figure as a dashed line across the panel and the
    P-processes-without-communication figure as a dotted line over its group. Needs
    matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = derive(run["results"])
    models = [m for m in MODELS if any(r["model"] == m for r in rows)] or ["fc"]
    fig, axes = plt.subplots(len(models), 1, figsize=(12, 3.8 * len(models)), squeeze=False)
    names = [c.name for c in CONFIGS if c.kind in ("mwms", "poseidon")]
    colors = plt.get_cmap("tab10")
    for ax, model in zip(axes[:, 0], models):
        mine = [r for r in rows if r["model"] == model]
        combos = sorted({(r["ranks"], r["bandwidth"]) for r in mine if r["ranks"] > 1},
                        key=lambda c: (c[0], rate_bits(c[1]) or 0))
        width = 0.8 / len(names)
        top = max([r["samples_per_s"] for r in mine if _ok(r) and r["config"] != "concurrent"]
                  or [1.0])
        for i, name in enumerate(names):
            for j, (ranks, bandwidth) in enumerate(combos):
                r = find(mine, model, name, ranks, bandwidth)
                x = j + (i - (len(names) - 1) / 2) * width
                if r is None:
                    continue
                value = r["samples_per_s"] if _ok(r) else 0
                ax.bar(x, value, width, color=colors(i % 10), label=name if j == 0 else None)
                if _ok(r):
                    ax.annotate(f"{value:.1f}", (x, value), ha="center", va="bottom", fontsize=6)
                else:
                    ax.annotate("n/a" if r["status"] == "not available" else "failed",
                                (x, 0.02 * top), ha="center", va="bottom", fontsize=6,
                                rotation=90, color="gray")
        for j, (ranks, bandwidth) in enumerate(combos):
            r = find(mine, model, "concurrent", ranks, bandwidth)
            if _ok(r):
                ax.hlines(r["samples_per_s"], j - 0.45, j + 0.45, colors="black",
                          linestyles="dotted", label="P processes, no comm." if j == 0 else None)
                ax.annotate(f"{r['samples_per_s']:.1f}", (j + 0.45, r["samples_per_s"]),
                            ha="left", va="center", fontsize=6)
        single = find(mine, model, "single")
        if _ok(single):
            ax.axhline(single["samples_per_s"], color="black", linestyle="--", linewidth=1,
                       label=f"one process ({single['samples_per_s']:.1f})")
        ax.set_xticks(range(len(combos)))
        ax.set_xticklabels([link_label(b, n) for n, b in combos])
        ax.set_xlim(-0.6, max(1, len(combos)) - 0.4)
        ax.set_ylabel("samples/s (all ranks)")
        ax.set_title(_title(model))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("tf_poseidon vs MultiWorkerMirroredStrategy, emulated Ethernet, "
                 f"batch {run['settings']['batch']} per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
