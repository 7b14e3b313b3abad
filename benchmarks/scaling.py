"""The step model (tf_poseidon/sacp/step_model.py) against the suite's measured step times, and
its projection to 8-64 hosts (docs/benchmarks.md, "Scaling prediction"). Reads a suite run's
JSON (--results); times this machine's SFB reconstruction and fp16 conversion; takes each
link's effective bandwidth and the network stack's rate from --link-gbps and --stack-gbps
(docs/cluster.md's all-reduce figures)."""

import json
import os
import sys

from benchmarks import models, report, runner
from benchmarks.kernels import timings

PROTOCOL = {"naive": "naive", "dwbp": "allreduce", "fp16": "fp16", "sfb": "sfb",
            "fp16+sfb": "fp16+sfb", "powersgd": "lowrank"}
PUBLISHED = ("Poseidon (Zhang et al., ATC'17): 31.5x on 32 nodes for Inception-V3, 40 GbE; "
             "Horovod (Sergeev & Del Balso, 2018): 90% scaling efficiency at 512 GPUs for "
             "Inception-V3 and ResNet-101, 68% for VGG-16, 25 GbE RoCE")


def local_rates() -> dict:
    """This machine's SFB reconstruction (flop/s), float32 -> fp16 conversion (bytes/s),
    PowerSGD rank-4 compute (gradient elements/s) and memory copy (bytes/s), one thread, best
    of several."""
    import numpy as np
    from tf_poseidon import host_kernels, ops
    from tf_poseidon.sacp import cost_model
    u, v = np.ones((64, 2048), np.float32), np.ones((64, 2048), np.float32)
    x, out = np.ones(16 << 20, np.float32), np.empty(16 << 20, np.float16)
    best = lambda fn: timings({"": fn}, 5)[""][0] / 1e3  # noqa: E731  (seconds)
    m, n = cost_model.PROBE_LOWRANK
    return {"flops_s": 2 * 64 * 2048 * 2048 / best(lambda: ops.sfb_reconstruct(u, v).numpy()),
            "convert_bytes_s": x.nbytes / best(lambda: host_kernels.convert(x, out, 1.0)),
            "lowrank_elements_s": m * n / cost_model.time_lowrank(4),
            "copy_bytes_s": cost_model.PROBE_COPY_BYTES / cost_model.time_copy()}


def measure(args, bench) -> dict:
    from tf_poseidon.sacp import step_model
    with open(args.results) as f:
        results = [r for r in json.load(f)["results"] if r["status"] == "ok"]
    rates, links = local_rates(), dict(pair.split("=") for pair in args.link_gbps)
    cores = os.cpu_count() or 1

    def machine(gbps: float, ranks: int, shared: bool):
        # Emulated hosts share this machine's cores with the network stack; projected hosts
        # have cores to spare for it.
        return step_model.Machine(
            gbps * 1e9 / 8, args.latency_us * 1e-6, rates["flops_s"], rates["convert_bytes_s"],
            rates["lowrank_elements_s"], args.stack_gbps * 1e9 / 8 if shared else float("inf"),
            min(1.0, cores / ranks) if shared else 1.0, rates["copy_bytes_s"])
    rows, projections = [], []
    for name in args.models:
        layers = step_model.layers_of(models.build(models.MODELS[name]))
        single = report.find(results, name, "single")
        for r in results:
            concurrent = report.find(results, name, "concurrent", r["ranks"], r["bandwidth"])
            if r["model"] != name or r["config"] not in PROTOCOL or not concurrent:
                continue
            estimate = step_model.estimate(
                layers, PROTOCOL[r["config"]], r["ranks"], args.batch, concurrent["step_s"],
                machine(float(links[r["bandwidth"]]), r["ranks"], shared=True))
            rows.append({"model": name, "ranks": r["ranks"], "bandwidth": r["bandwidth"],
                         "config": r["config"], "measured_s": r["step_s"],
                         "predicted_s": estimate.step_s})
        for hosts in args.hosts:
            for gbps in args.project_gbps:
                steps = {p: step_model.estimate(layers, p, hosts, args.batch, single["step_s"],
                                                machine(gbps, hosts, shared=False)).step_s
                         for p in step_model.PROTOCOLS}
                projections.append({"model": name, "hosts": hosts, "gbps": gbps,
                                    "compute_s": single["step_s"], "step_s": steps})
    return {"rates": rates, "rows": rows, "projections": projections}


def table(results: dict) -> list[str]:
    rows = results["rows"]
    within = sum(abs(r["predicted_s"] / r["measured_s"] - 1) <= 0.15 for r in rows)
    lines = report.table(["model", "hosts × link", "configuration", "measured step s",
                          "predicted s", "predicted / measured"], [
        [report.MODELS[r["model"]].title, report.link_label(r["bandwidth"], r["ranks"]),
         r["config"], f"{r['measured_s']:.3f}", f"{r['predicted_s']:.3f}",
         f"{r['predicted_s'] / r['measured_s']:.2f}"] for r in rows])
    lines += ["", f"Within 15%: {within} of {len(rows)}. Rates timed here: SFB reconstruction "
              f"{results['rates']['flops_s'] / 1e9:.0f} GFlop/s, fp16 conversion "
              f"{results['rates']['convert_bytes_s'] / 1e9:.1f} GB/s, copy "
              f"{results['rates']['copy_bytes_s'] / 1e9:.1f} GB/s.", "",
              "Projection (hosts of their own, one compute thread each and cores to spare for "
              "the network stack; scaling efficiency = compute-only step / step, i.e. "
              "throughput over hosts × one host's):", ""]
    protocols = list(results["projections"][0]["step_s"]) if results["projections"] else []
    lines += report.table(["model", "hosts", "Gbit/s", *protocols], [
        [report.MODELS[p["model"]].title, p["hosts"], f"{p['gbps']:g}",
         *[f"{p['compute_s'] / p['step_s'][q]:.0%}" for q in protocols]]
        for p in results["projections"]])
    return lines + ["", f"Published: {PUBLISHED}."]


if __name__ == "__main__":
    sys.exit(runner.feature_main(
        __doc__, measure, table, emulated=False,
        results=os.path.join(runner.ROOT, "docs", "benchmarks", "results.json"),
        models=["fc", "vgg", "resnet"], batch=32, latency_us=20.0, stack_gbps=3.6,
        link_gbps=["1gbit=0.94", "10gbit=3.6"], hosts=[8, 16, 32, 64],
        project_gbps=[1.0, 10.0, 25.0]))
