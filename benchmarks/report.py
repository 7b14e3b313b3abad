"""Turning a benchmark run (the JSON the suite writes) into tables, goals and a chart.

Pure functions of the run dict, so a report can be rebuilt from a saved run
(``python -m benchmarks.suite --report-only RUN.json``). The run dict::

    {"command": str, "started": iso, "finished": iso | None, "status": "running" | "complete"
     | "interrupted", "settings": {...}, "environment": {...}, "emulation": str,
     "results": [result, ...]}

and one ``result`` per measured (model, configuration, ranks, bandwidth)::

    {"model", "config", "ranks", "bandwidth" (tc rate or None), "status": "ok" | "not
     available" | "failed" | "timed out" | "interrupted", "message", "samples_per_s",
     "step_s" (mean over the timed steps, slowest rank), "step_median_s", "steps",
     "tx_bytes_per_step" / "rx_bytes_per_step" (one per host, None unmeasured),
     "engine_bytes_per_step", "hidden_fraction" (tf_poseidon's own stats, when it has them),
     "wall_s"}

Definitions (also printed in docs/benchmarks.md): *compute-only step* = the one-process step
time of the same model at the same per-rank batch; *overhead* = step / compute-only step;
*× MWMS* = samples/s over MultiWorkerMirroredStrategy's at the same ranks and link; *floor* =
max(compute-only step, bytes the busiest host sends per step / link bandwidth).
"""

from __future__ import annotations

import dataclasses
import re

from benchmarks.models import MODELS

# Goals of the issue (measured at 2 emulated hosts, 1 Gbit/s, batch 32 per rank).
GOAL_VS_MWMS_FC = 5.0
GOAL_VS_MWMS_CNN = 2.0
GOAL_VS_ONE_PROCESS_2_HOSTS = 1.7
GOAL_STEP_OVER_COMPUTE = 1.2

# DESIGN.md's anchor figures (2 emulated hosts at 1 Gbit/s, samples/s of all ranks together).
ANCHORS = [
    ("fc", "single", 1, "VGG-16 head, one process", 27.1),
    ("fc", "mwms", 2, "VGG-16 head, MWMS, 2 hosts × 1 Gbit/s", 6.5),
    ("resnet", "single", 1, "ResNet-50 64×64, one process", 8.6),
    ("resnet", "mwms", 2, "ResNet-50 64×64, MWMS, 2 hosts × 1 Gbit/s", 7.1),
]


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
    # lowrank as a dict of PowerSGD's arguments (the options travel to the worker as JSON);
    # start_step=0: the few steps timed are the compressed steady state, not the warm-up.
    Config("powersgd", "DWBP + lowrank=PowerSGD(rank=4): all-reduce, SFB or low-rank per layer",
           "poseidon", (("lowrank", {"rank": 4, "start_step": 0}),)),
    Config("powersgd-always", "DWBP + PowerSGD(rank=4, choice='always'): every matrix "
           "compressing >= 2x", "poseidon",
           (("lowrank", {"rank": 4, "start_step": 0, "choice": "always"}),)),
    Config("ssp", "mode='ssp', staleness=2", "poseidon", (("mode", "ssp"), ("staleness", 2))),
    # alpha = 0.9/P: synchronous EASGD needs alpha·P < 1 (tf_poseidon refuses the default
    # alpha=0.5 on 2 or more ranks); 0.9 is Zhang et al.'s beta = alpha·P.
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
    if ranks == 1:
        return "1 process"
    return f"{ranks} hosts × {bandwidth or 'unshaped'}"


# -- derived figures -------------------------------------------------------------------------


def _ok(r: dict | None) -> bool:
    return r is not None and r.get("status") == "ok" and r.get("samples_per_s")


def find(results: list[dict], model: str, config: str, ranks: int | None = None,
         bandwidth: str | None = "*") -> dict | None:
    """The result for (model, config[, ranks, bandwidth]); ``bandwidth="*"`` matches any."""
    for r in results:
        if (r["model"] == model and r["config"] == config
                and (ranks is None or r["ranks"] == ranks)
                and (bandwidth == "*" or r["bandwidth"] == bandwidth)):
            return r
    return None


def derive(results: list[dict]) -> list[dict]:
    """Each result with the figures that need other results: ``compute_s``, ``overhead``,
    ``vs_mwms``, ``vs_one_process``, ``wire_bytes_per_step`` (busiest host's sent bytes),
    ``floor_s``, ``notes``. Sorted by model, ranks, bandwidth, configuration order."""
    rows = []
    for r in results:
        row = dict(r)
        single = find(results, r["model"], "single")
        compute_s = single["step_s"] if _ok(single) else None
        mwms = find(results, r["model"], "mwms", r["ranks"], r["bandwidth"])
        tx = [b for b in (r.get("tx_bytes_per_step") or []) if b is not None]
        wire = max(tx) if tx else None
        bits = rate_bits(r["bandwidth"])
        row["compute_s"] = compute_s
        row["wire_bytes_per_step"] = wire
        row["overhead"] = r["step_s"] / compute_s if _ok(r) and compute_s else None
        distributed = CONFIG_BY_NAME.get(r["config"], Config("", "", "")).kind in (
            "mwms", "poseidon")
        row["vs_mwms"] = (r["samples_per_s"] / mwms["samples_per_s"]
                          if distributed and _ok(r) and _ok(mwms) else None)
        row["vs_one_process"] = (r["samples_per_s"] / single["samples_per_s"]
                                 if _ok(r) and _ok(single) else None)
        parts = [compute_s, wire * 8 / bits if wire is not None and bits else None]
        floor = max((p for p in parts if p is not None), default=None)
        row["floor_s"] = floor if _ok(r) else None
        row["notes"] = _notes(results, r, wire)
        rows.append(row)
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
    """Automatic remarks: a byte-saving option that saved no bytes, failures."""
    if r["status"] != "ok":
        return _failure(r)
    notes = []
    baseline = find(results, r["model"], "dwbp", r["ranks"], r["bandwidth"])
    base_tx = [b for b in (baseline or {}).get("tx_bytes_per_step") or [] if b is not None]
    if wire is not None and base_tx and _ok(baseline) and r["config"] in ("fp16", "sfb",
                                                                          "fp16+sfb"):
        ratio = wire / max(base_tx)
        if ratio > 0.97:
            notes.append(f"sends {ratio:.0%} of DWBP's bytes: the option saved no traffic")
        else:
            notes.append(f"sends {ratio:.0%} of DWBP's bytes")
    single = find(results, r["model"], "single")
    if (r["ranks"] > 1 and _ok(single) and r["config"] != "concurrent"
            and r["step_s"] < single["step_s"]):
        notes.append("faster than the compute-only step: load changed between the two "
                     "measurements")
    tau = dict(CONFIG_BY_NAME[r["config"]].options).get("tau") \
        if r["config"] in CONFIG_BY_NAME else None
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


def best_poseidon(rows: list[dict], model: str, ranks: int, bandwidth) -> dict | None:
    """The tf_poseidon configuration with the most samples/s at (model, ranks, bandwidth)."""
    candidates = [r for r in rows if r["model"] == model and r["ranks"] == ranks
                  and r["bandwidth"] == bandwidth and _ok(r)
                  and CONFIG_BY_NAME.get(r["config"], Config("", "", "")).is_poseidon]
    return max(candidates, key=lambda r: r["samples_per_s"], default=None)


def goals(rows: list[dict]) -> list[dict]:
    """One goal row per measured (model, ranks, bandwidth): the best tf_poseidon
    configuration and its ratios against MWMS, one process and the compute-only step, each
    with the issue's goal and whether it is met (True/False; None = no goal or no figure)."""
    out = []
    combos = sorted({(r["model"], r["ranks"], r["bandwidth"]) for r in rows if r["ranks"] > 1},
                    key=lambda c: (list(MODELS).index(c[0]) if c[0] in MODELS else 99, c[1],
                                   rate_bits(c[2]) or 0))
    for model, ranks, bandwidth in combos:
        best = best_poseidon(rows, model, ranks, bandwidth)
        fc = MODELS[model].fc_heavy if model in MODELS else False
        goal_mwms = GOAL_VS_MWMS_FC if fc else GOAL_VS_MWMS_CNN
        goal_one = GOAL_VS_ONE_PROCESS_2_HOSTS if ranks == 2 else None
        g = {"model": model, "ranks": ranks, "bandwidth": bandwidth,
             "best": best["config"] if best else None,
             "best_samples_per_s": best["samples_per_s"] if best else None,
             "vs_mwms": best and best["vs_mwms"], "goal_vs_mwms": goal_mwms,
             "vs_one_process": best and best["vs_one_process"], "goal_vs_one_process": goal_one,
             "overhead": best and best["overhead"], "goal_overhead": GOAL_STEP_OVER_COMPUTE,
             "over_floor": (best["step_s"] / best["floor_s"]
                            if best and best.get("floor_s") else None)}
        concurrent = find(rows, model, "concurrent", ranks, bandwidth)
        g["vs_concurrent"] = (best["samples_per_s"] / concurrent["samples_per_s"]
                              if best and concurrent and concurrent.get("samples_per_s")
                              else None)
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
    text = f"{value:.2f}×"
    if goal is None:
        return f"{text} (no goal)"
    return f"{text} (goal {sense} {goal:g}×: {'met' if met else 'NOT met'})"


def result_table(rows: list[dict], markdown: bool = True) -> list[str]:
    """The results as table lines (markdown, or aligned plain text for the console)."""
    head = ["model", "hosts × link", "configuration", "samples/s", "step s", "× compute",
            "× MWMS", "wire MB/step", "floor s", "load", "notes"]
    body = []
    for r in rows:
        body.append([
            MODELS[r["model"]].title if r["model"] in MODELS else r["model"],
            link_label(r["bandwidth"], r["ranks"]),
            r["config"],
            _num(r.get("samples_per_s"), ".1f"),
            _num(r.get("step_s"), ".3f"),
            _num(r.get("overhead"), ".2f", "×"),
            _num(r.get("vs_mwms"), ".2f", "×"),
            _num(None if r.get("wire_bytes_per_step") is None
                 else r["wire_bytes_per_step"] / 1e6, ".1f"),
            _num(r.get("floor_s"), ".3f"),
            _num(r.get("loadavg"), ".1f"),
            r.get("notes") or "",
        ])
    return _table(head, body, markdown)


def goal_table(goal_rows: list[dict], markdown: bool = True) -> list[str]:
    head = ["model", "hosts × link", "best tf_poseidon", "samples/s", "vs MWMS",
            "vs one process", "vs P processes, no comm.", "step ÷ compute-only step",
            "step ÷ floor"]
    body = []
    for g in goal_rows:
        overhead = ("not measured" if g["overhead"] is None else
                    f"{g['overhead']:.2f}× (goal ≤ {g['goal_overhead']:g}×: "
                    f"{'met' if g['met_overhead'] else 'NOT met'})")
        body.append([
            MODELS[g["model"]].title if g["model"] in MODELS else g["model"],
            link_label(g["bandwidth"], g["ranks"]),
            g["best"] or "none measured",
            _num(g["best_samples_per_s"], ".1f"),
            _goal_cell(g["vs_mwms"], g["goal_vs_mwms"], g["met_vs_mwms"], "≥"),
            _goal_cell(g["vs_one_process"], g["goal_vs_one_process"], g["met_vs_one_process"],
                       "≥"),
            _num(g["vs_concurrent"], ".2f", "×"),
            overhead,
            _num(g["over_floor"], ".2f", "×"),
        ])
    return _table(head, body, markdown)


def anchor_table(rows: list[dict], markdown: bool = True) -> list[str]:
    head = ["figure (samples/s, all ranks)", "DESIGN.md", "this run"]
    body = []
    for model, config, ranks, label, value in ANCHORS:
        here = None
        for r in rows:
            if (r["model"] == model and r["config"] == config and r["ranks"] == ranks
                    and (ranks == 1 or r["bandwidth"] == "1gbit") and _ok(r)):
                here = r["samples_per_s"]
        body.append([label, f"{value:.1f}", _num(here, ".1f")])
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

HOROVOD = """\
## Horovod

Horovod is not in the comparison because it cannot be built against TensorFlow 2.21.
`pip install horovod==0.28.1` (the last release) fails while compiling its TensorFlow
extension (DESIGN.md): `horovod/tensorflow/xla_mpi_ops.cc` includes XLA headers whose own
dependency, `highwayhash`, the TensorFlow 2.21 wheel does not ship. Compiling that one file of
the 0.28.1 sdist against this venv's TensorFlow with TensorFlow's own flags
(`g++ -std=c++17 -fsyntax-only $(python -c "import tensorflow as tf;
print(' '.join(tf.sysconfig.get_compile_flags()))") -I. ... horovod/tensorflow/xla_mpi_ops.cc`)
stops at:

```
In file included from .../tensorflow/include/xla/layout.h:32,
                 from .../tensorflow/include/xla/shape.h:37,
                 ...
                 from .../tensorflow/include/tensorflow/compiler/tf2xla/xla_op_kernel.h:23,
                 from horovod/tensorflow/xla_mpi_ops.cc:25:
.../tensorflow/include/xla/printer.h:29:10: fatal error: highwayhash/arch_specific.h: \
No such file or directory
   29 | #include "highwayhash/arch_specific.h"
compilation terminated.
```

`horovodrun` refuses to run without a built Horovod extension, so not even its launcher can
start a job. Upstream's change for building against newer TensorFlow is an open pull request
(horovod/horovod#4302, "Enable building against tf v2.20"), and Horovod's Keras wrappers do not
support Keras 3. TensorFlow's own MultiWorkerMirroredStrategy is therefore the baseline here.
"""

DEFINITIONS = """\
## How the figures are measured

- **samples/s**: rows processed per second by all ranks together over the timed steps
  (Σ over ranks of batch × timed steps ÷ the slowest rank's timed wall time).
- **step s**: wall time per timed step of the slowest rank, from the end of the last warm-up
  step to the end of the last step; a step ends when its loss has reached Python (Keras
  callback `on_train_batch_end` for `fit`; `.numpy()` of the loss in MWMS's custom loop).
- **× compute**: step time ÷ the compute-only step time (one process, no strategy, same
  model and per-rank batch). The issue's goal is ≤ 1.2×.
- **× MWMS**: samples/s ÷ MultiWorkerMirroredStrategy's samples/s at the same hosts and link,
  in the same run.
- **wire MB/step**: bytes the busiest host sent per timed step, read from its `eth0`
  transmit counter (`/proc/net/dev` inside the host's namespace) before and after the timed
  steps — everything on the wire: payload, TCP/IP and Ethernet headers, control messages.
- **floor s**: the physical limit of a step, max(compute-only step, wire bytes ÷ link
  bandwidth); **step ÷ floor** in the goal table says how far the best configuration is from
  it (1.00× = nothing left to gain without sending fewer bytes or computing faster).
- **load**: the machine's 1-minute load average at the end of the configuration (2 cores;
  other jobs share the machine, so figures measured at a high load are pessimistic).
- **concurrent**: P copies of the one-process run on the P hosts at once, with no
  communication: what sharing this machine's cores costs by itself (with 4 ranks on 2 cores
  each rank has half a core, so nothing distributed can beat this row there).
  **vs P processes, no comm.** in the goal table is the best configuration's samples/s ÷ this
  row's: the fraction of what this machine's cores allow that the configuration reaches. All
  emulated hosts share 2 cores, so "2 hosts ≥ 1.7× one process" can only be met where two
  processes alone reach 1.7× one (the concurrent row), which is true of the FC model only.
- A configuration whose constructor raises NotImplementedError is listed as *not available*
  with the message; rerunning the suite measures it once the feature exists.
"""


def markdown(run: dict) -> str:
    """docs/benchmarks.md for ``run``."""
    rows = derive(run["results"])
    s = run["settings"]
    env = run["environment"]
    status = {"complete": "complete",
              "running": "partial (the run was still going or was killed)",
              "interrupted": "partial (interrupted)"}.get(run.get("status"), run.get("status"))
    lines = [
        "# Benchmarks: tf_poseidon vs TensorFlow's MultiWorkerMirroredStrategy",
        "",
        "Generated by `benchmarks/suite.py` (do not edit by hand; rerun it). Synthetic data, "
        "an emulated commodity-Ethernet cluster on one machine, every configuration in the "
        "same run.",
        "",
        f"- Run: {run['started']} → {run.get('finished') or '…'}, **{status}**",
        "- Command (from the repository root, as root, venv active):",
        "",
        "  ```",
        f"  {run['command']}",
        "  ```",
        "",
        "![samples/s per configuration](benchmarks.png)",
        "",
        "## Results",
        "",
        f"Models: {', '.join(MODELS[m].title for m in s['models'] if m in MODELS)}. "
        f"Batch {s['batch']} per rank, {s['warmup']} warm-up step(s) then {s['steps']} timed "
        f"step(s) per configuration, 1 intra-op thread per rank, SGD, no metrics.",
        "",
        *result_table(rows),
        "",
        *_load_warning(rows, env),
        "## Goals of the issue",
        "",
        "Best tf_poseidon configuration at each number of hosts and link; goals: ≥ 5× MWMS "
        "on the FC-heavy model and ≥ 2× on the CNNs, 2 hosts ≥ 1.7× one process, step time "
        "≤ 1.2× the compute-only step.",
        "",
        *goal_table(goals(rows)),
        "",
        *_goal_caveats(rows),
        "DESIGN.md's anchor figures (measured earlier on this machine, before docs/cluster.md "
        "found that Open MPI's default core binding distorted figures taken through `mpirun`; "
        "the machine's load then is not known) against this run:",
        "",
        *anchor_table(rows),
        "",
        "## Set-up",
        "",
        f"- Emulation: {run['emulation']}",
        "- tf_poseidon configurations: `tfposeidon-run` with the cluster's `launcher_args()` "
        "(`--bind-to none`, `mpi_yield_when_idle`, TCP over `eth0`), Keras `fit` on global "
        "batches of ranks × batch rows.",
        "- MultiWorkerMirroredStrategy: plain Python processes started by the same real "
        "multi-host `mpirun` (the cluster's `mpirun_args()`, `--bind-to none`: nothing "
        "pinned); each builds `TF_CONFIG` from the hosts' addresses and its rank; "
        "`CommunicationImplementation.RING` (gRPC over `eth0`); a custom training loop "
        "(`strategy.run` + `GradientTape` + `apply_gradients`), since Keras 3 `fit` fails under "
        "it in TF 2.21 (keras#20585).",
        "- Every rank: `TF_NUM_INTRAOP_THREADS=1` (and `TF_POSEIDON_INTRA_THREADS=1`), "
        "TensorFlow's default 2 inter-op threads, no XLA (`jit_compile=False`).",
        "- Data: Horovod's synthetic benchmark — one random batch with fixed random labels, "
        "fed every step (`tf.data.Dataset.from_tensors(...).repeat()`).",
        f"- Per-configuration timeout: {s['timeout']:g} s.",
        "",
        "Environment:",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in env.items()],
        "",
        DEFINITIONS,
        HOROVOD,
    ]
    failed = [r for r in rows if r["status"] not in ("ok", "not available", "not run")]
    if failed:
        lines += ["## Failures", ""]
        lines += [f"- {r['model']} {link_label(r['bandwidth'], r['ranks'])} {r['config']}: "
                  f"{_failure(r)}" for r in failed]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _goal_caveats(rows: list[dict]) -> list[str]:
    """A paragraph naming goal verdicts that rest on a step faster than the compute-only
    step, which no configuration can really be (every rank computes every step)."""
    suspect = [g for g in goals(rows) if g["overhead"] is not None and g["overhead"] < 1.0]
    if not suspect:
        return []
    names = ", ".join(f"{MODELS[g['model']].title if g['model'] in MODELS else g['model']} "
                      f"({link_label(g['bandwidth'], g['ranks'])}, {g['best']})"
                      for g in suspect)
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
        missing = []
        for i, name in enumerate(names):
            for j, (ranks, bandwidth) in enumerate(combos):
                r = find(mine, model, name, ranks, bandwidth)
                x = j + (i - (len(names) - 1) / 2) * width
                label = name if j == 0 else None
                if _ok(r):
                    ax.bar(x, r["samples_per_s"], width, color=colors(i % 10), label=label)
                    ax.annotate(f"{r['samples_per_s']:.1f}", (x, r["samples_per_s"]),
                                ha="center", va="bottom", fontsize=6)
                elif r is not None:
                    ax.bar(x, 0, width, color=colors(i % 10), label=label)
                    missing.append((x, "n/a" if r["status"] == "not available" else "failed"))
        for x, text in missing:
            ax.annotate(text, (x, 0.02 * top), ha="center", va="bottom", fontsize=6,
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
        ax.set_title(MODELS[model].title if model in MODELS else model)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("tf_poseidon vs MultiWorkerMirroredStrategy, emulated Ethernet, "
                 f"batch {run['settings']['batch']} per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
