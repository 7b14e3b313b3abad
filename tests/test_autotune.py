"""comm/autotune.py on loopback ranks: the trial schedule, the per-bucket codec choice and the
final choice are the same on every rank and pick what the measured times favour; real engines
run each step as its setting says."""

import time

import numpy as np
import pytest

from tf_poseidon.comm import autotune, codecs
from tf_poseidon.comm.buckets import Bucket, Item
from tf_poseidon.comm.engine import CollectiveGroup, CommEngine
from tf_poseidon.comm.protocol import AllReduce, BucketCall
from tf_poseidon.testing.loopback import LoopbackWorld

FLOAT_LAYOUT = (("allreduce", 4096, "float32"), ("allreduce", 4096, "float32"),
                ("sfb", 512, "float32"))


def drive(world, layout, codec, step_time, bucket_time, steps=30, tune_overlap=True):
    """Runs ``steps`` steps on every rank; a step under setting s takes ``step_time(rank, s)``
    seconds and bucket i ``bucket_time(i, codec name)``. Returns per rank the settings used
    and the tuner."""
    def rank_main(comm):
        tuner = autotune.GradientTuner(codec, tune_overlap)
        clock, used = 0.0, []
        for _ in range(steps):
            setting = tuner.begin(comm, layout, clock)
            used.append(setting)
            for index, (kind, _, _) in enumerate(layout):
                chosen = tuner.codec_of(setting, index)
                name = chosen.name if chosen is not None else codec.name
                tuner.bucket_done(layout, index, bucket_time(index, name))
            clock += step_time(comm.Get_rank(), setting)
        return used, tuner
    return world.run(rank_main)


@pytest.mark.parametrize("size", [2, 3])
def test_overlap_off_chosen_when_it_is_faster_everywhere(size):
    def step_time(rank, s):
        return (1.0 if not s.overlap else 1.3) + 0.01 * rank

    results = drive(LoopbackWorld(size), FLOAT_LAYOUT, codecs.get("none"), step_time,
                    lambda i, name: 0.1)
    settings = [used for used, _ in results]
    assert all(s == settings[0] for s in settings), "ranks ran different schedules"
    used = settings[0]
    warmup, rounds = autotune.DEFAULT_WARMUP, autotune.DEFAULT_ROUNDS
    assert used[:warmup] == [autotune.DEFAULT] * warmup
    trial = used[warmup:warmup + 2 * rounds]
    assert {s.overlap for s in trial} == {True, False}
    chosen = used[warmup + 2 * rounds:]
    assert chosen and all(s.overlap is False for s in chosen)
    report = results[0][1].report()
    assert report[0]["state"] == "chosen"
    assert report[0]["choice"] == "overlap off, codec none"
    assert [c["steps"] for c in report[0]["candidates"]] == [rounds, rounds]


def test_the_slowest_rank_decides():
    # Rank 1 is much slower with overlap off; rank 0 slightly faster: the job's step is the
    # slowest rank's, so overlap stays on.
    def step_time(rank, s):
        if rank == 1:
            return 2.0 if not s.overlap else 1.2
        return 1.0 if not s.overlap else 1.1

    results = drive(LoopbackWorld(2), FLOAT_LAYOUT, codecs.get("none"), step_time,
                    lambda i, name: 0.1)
    for used, tuner in results:
        assert used[-1].overlap is True
        assert tuner.report()[0]["choice"] == "overlap on, codec none"


def test_codec_per_bucket_then_mixed_candidate():
    # Bucket 0 is faster in fp16, bucket 1 exact; the SFB bucket keeps the configured codec.
    def bucket_time(index, name):
        return {(0, "fp16"): 0.1, (0, "none"): 0.3, (1, "fp16"): 0.3, (1, "none"): 0.1}.get(
            (index, name), 0.2)

    def step_time(rank, s):
        return 1.0 + sum(bucket_time(i, n) for i, n in enumerate(s.codecs or ("fp16",) * 3))

    results = drive(LoopbackWorld(2), FLOAT_LAYOUT, codecs.get("fp16"), step_time, bucket_time,
                    steps=40, tune_overlap=False)
    used, tuner = results[0]
    assert all(r[0] == used for r in results)
    assert used[-1].codecs == ("fp16", "none", "fp16")
    report = tuner.report()[0]
    assert report["choice"] == "overlap on, codec per bucket (2 fp16, 1 none)"
    assert len(report["candidates"]) == 3  # all fp16, all exact, mixed
    steps_in_trials = autotune.DEFAULT_WARMUP + 3 * autotune.DEFAULT_ROUNDS
    assert all(s == used[-1] for s in used[steps_in_trials:])


def test_exact_codec_is_never_replaced_nor_bf16_nor_a_16_bit_payloads():
    layout = (("allreduce", 2048, "bfloat16"), ("allreduce", 4096, "float32"))
    results = drive(LoopbackWorld(2), layout, codecs.get("bf16"), lambda r, s: 1.0,
                    lambda i, name: 0.1, tune_overlap=False)
    for used, _ in results:  # bf16 packs on the device in bfloat16: never replaced
        assert all(s.codecs is None or set(s.codecs) == {"bf16"} for s in used)
    results = drive(LoopbackWorld(2), layout, codecs.get("fp16"), lambda r, s: 1.0,
                    lambda i, name: 0.1, tune_overlap=False)
    for used, _ in results:  # fp16 may give way, but not on a bucket planned in 16 bits
        assert {s.codecs[1] for s in used if s.codecs} == {"fp16", "none"}
        assert all(s.codecs is None or s.codecs[0] == "fp16" for s in used)
    none_results = drive(LoopbackWorld(2), layout, codecs.get("none"), lambda r, s: 1.0,
                         lambda i, name: 0.1, tune_overlap=False)
    for used, _ in none_results:
        assert all(s.codecs is None or set(s.codecs) == {"none"} for s in used)


def test_a_new_layout_gets_trials_of_its_own():
    world = LoopbackWorld(2)

    def rank_main(comm):
        tuner = autotune.GradientTuner(codecs.get("none"))
        first = [tuner.begin(comm, FLOAT_LAYOUT, float(t)) for t in range(20)]
        other = tuner.begin(comm, FLOAT_LAYOUT[:1], 100.0)
        return first, other, tuner.report()
    for first, other, report in world.run(rank_main):
        assert other == autotune.DEFAULT  # the new layout's first warm-up step
        assert len(report) == 2 and report[0]["state"] == "chosen"
        assert report[1]["state"].startswith("measuring")


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rounds >= 1"):
        autotune.GradientTuner(codecs.get("none"), rounds=0)


class RecordingTuner(autotune.GradientTuner):
    """Remembers the setting of every step it began."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = []

    def begin(self, comm, layout, started_at):
        setting = super().begin(comm, layout, started_at)
        self.settings.append(setting)
        return setting


@pytest.mark.parametrize("size", [2, 3])
def test_engine_runs_each_step_as_its_setting_says(size):
    """Real engines on loopback ranks: buckets handed over late and out of order; a step whose
    setting has overlap off is posted only once all its buckets are there; a bucket given the
    exact codec sums exactly, one given fp16 within fp16's rounding; every rank gets the same
    sums and the same settings."""
    sizes, steps = (1000, 3000, 500), 24
    items = [Item(f"g/{i}", (n,), np.dtype(np.float32), n) for i, n in enumerate(sizes)]
    rng = np.random.default_rng(7)
    values = rng.standard_normal((steps, size, sum(sizes))).astype(np.float32)

    def part(step, rank, index):
        start = sum(sizes[:index])
        return values[step, rank, start:start + sizes[index]].copy()

    def rank_main(comm):
        fp16 = codecs.HalfPrecision("fp16", np.float16, scaled=True)  # wire buffers per rank
        tuner = RecordingTuner(fp16)
        engine = CommEngine(comm)
        group = CollectiveGroup("gradients", [Bucket(i, "allreduce", (i,), (item,),
                                                     item.payload_dtype)
                                              for i, item in enumerate(items)],
                                {"allreduce": AllReduce(fp16)}, tuner)
        jitter = np.random.default_rng(comm.rank)
        results = []
        for step in range(steps):
            for index in range(len(sizes)):
                engine.submit(group, index, part(step, comm.rank, index))
                time.sleep(0.002 * jitter.random())
            results.append([group.wait_result(i, 20) for i in range(len(sizes))])
        return results, tuner.settings, engine.stats.records()

    outcomes = LoopbackWorld(size, timeout_s=20).run(rank_main)
    settings = outcomes[0][1]
    assert len(settings) == steps and all(o[1] == settings for o in outcomes)
    assert {s.overlap for s in settings} == {True, False}
    assert {name for s in settings if s.codecs for name in s.codecs} == {"fp16", "none"}
    for results, _, records in outcomes:
        by_step = {}
        for r in records:
            by_step.setdefault(r.instance, []).append(r)
        for step, (setting, sums) in enumerate(zip(settings, results)):
            if not setting.overlap:
                step_records = by_step[step]
                assert min(r.start for r in step_records) >= max(r.queued_at
                                                                 for r in step_records)
            for index, summed in enumerate(sums):
                exact = sum(part(step, p, index).astype(np.float64) for p in range(size))
                name = setting.codecs[index] if setting.codecs else "fp16"
                tolerance = 1e-5 if name == "none" else 2e-3 * np.max(np.abs(exact))
                np.testing.assert_allclose(summed, exact, rtol=0, atol=tolerance)
        for other, _, _ in outcomes:
            for mine, theirs in zip(results, other):
                for a, b in zip(mine, theirs):
                    np.testing.assert_array_equal(a, b)


def test_strategy_option_is_checked():
    from tf_poseidon.config import StrategyConfig
    assert StrategyConfig().autotune is True
    assert StrategyConfig(autotune=False).autotune is False
    with pytest.raises(ValueError, match="autotune='yes' is not valid"):
        StrategyConfig(autotune="yes")


@pytest.mark.parametrize("codec,tune_overlap", [("none", True), ("fp16", True),
                                                ("fp16", False), ("none", False)])
def test_trial_steps_bound_the_trials(codec, tune_overlap):
    # Step times that differ per candidate (so a mixed candidate is tried with fp16).
    def bucket_time(index, name):
        return {(0, "fp16"): 0.1, (1, "none"): 0.1}.get((index, name), 0.3)

    results = drive(LoopbackWorld(2), FLOAT_LAYOUT, codecs.get(codec),
                    lambda rank, s: 1.0 + 0.1 * (not s.overlap), bucket_time, steps=30,
                    tune_overlap=tune_overlap)
    used, tuner = results[0]
    bound = autotune.trial_steps(codec != "none", tune_overlap)
    assert tuner.report()[0]["state"] == "chosen"
    assert all(s == used[bound] for s in used[bound:])
    if codec != "none":  # the bound is reached: all three codec candidates were tried
        assert len(tuner.report()[0]["candidates"]) == 3 * (2 if tune_overlap else 1)


def test_a_codec_of_ones_own_is_kept():
    class Halves(codecs.Codec):  # not tunable: the autotuner must not send it exactly
        name, wire_dtype, meta_size = "halves-for-test", np.dtype(np.float16), 0

    results = drive(LoopbackWorld(2), FLOAT_LAYOUT, Halves(), lambda r, s: 1.0,
                    lambda i, name: 0.1 if name == "none" else 1.0)
    for used, tuner in results:
        assert all(s.codecs is None or set(s.codecs) == {"halves-for-test"} for s in used)
        assert {c["setting"] for c in tuner.report()[0]["candidates"]} == {
            "overlap on, codec halves-for-test", "overlap off, codec halves-for-test"}


def test_a_payload_packed_in_16_bits_keeps_its_codec():
    """The device form hands bf16's sum a bfloat16 payload (codecs.pack_dtype): an exact
    codec chosen for the bucket cannot sum it, so the bucket's own codec does."""
    import ml_dtypes
    item = Item("g", (64,), np.dtype(np.float32), 64)
    bucket = Bucket(0, "allreduce", (0,), (item,), item.payload_dtype)

    def rank_main(comm):
        bf16 = codecs.HalfPrecision("bf16", ml_dtypes.bfloat16, scaled=False)
        payload = np.full(64, comm.Get_rank() + 1, ml_dtypes.bfloat16)
        call = BucketCall("gradients", 0, 0, bucket, payload, codecs.get("none"))
        return AllReduce(bf16).run(comm, call)

    for result in LoopbackWorld(2).run(rank_main):
        assert result.value.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(result.value.astype(np.float32), 3.0)
        assert result.bytes_sent == pytest.approx(64 * 2 / 2 * 2)  # bf16's bytes, not 4
