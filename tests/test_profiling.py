"""tf_poseidon.profiling: the phase of each profiler event, self times of nested events, and
real profiles of a 2-rank fit (the phases the step's path has are there and non-zero)."""

import json

import pytest

from multirank import check, run_job
from tf_poseidon import profiling


@pytest.mark.parametrize("event,phase", [
    ("gradient_tape/dense/MatMul:_MklMatMul", "compute"),
    ("tp_enqueue_gradients_3:EagerPyFunc", "enqueue"),
    ("while/body/_1/tp_collect_gradients_0:PyFunc", "collect"),
    ("PoseidonPack:PoseidonPack", "device_pack"),
    ("sgd/PoseidonUnpack:PoseidonUnpack", "device_pack"),
    ("PoseidonSfbReconstruct_2:PoseidonSfbReconstruct", "sfb_reconstruct"),
    ("ExecutorState::Process", None),
    ("EagerLocalExecute: __inference_train_function_1234", None),
    ("EagerExecute", None),
])
def test_event_phases(event, phase):
    assert profiling.op_phase(event) == phase


def test_self_times_subtract_nested_ops_only():
    # A 10 ps call op holding a 4 ps enqueue and (outside any op) an executor event.
    events = [(0, 10, "compute"), (2, 6, "enqueue"), (7, 8, None), (20, 25, "collect")]
    assert sorted(profiling._self_times(events)) == [
        ("collect", 5e-12), ("compute", 6e-12), ("enqueue", 4e-12)]


def test_table_has_every_phase():
    profile = profiling.StepProfile(2, 0.5, {"compute": 0.25, "wire": 0.1})
    table = profile.table()
    assert all(name in table for name in profiling.PHASES)
    assert "50%" in table  # compute's share of the step


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="first_step >= 0 and steps >= 1"):
        profiling.StepProfiler(first_step=0, steps=0)


@pytest.mark.multirank
@pytest.mark.parametrize("options,phases", [
    ({"sfb": "never"}, ["compute", "enqueue", "collect", "wire"]),
    ({"sfb": "always"}, ["compute", "enqueue", "collect", "wire", "sfb_reconstruct"]),
])
def test_profile_of_a_two_rank_fit(options, phases):
    out = check(run_job(2, "profile_steps.py", json.dumps(options))[0])
    profiles = [json.loads(line.split("PROFILE ", 1)[1]) for line in out.splitlines()
                if "PROFILE " in line]
    assert sorted(p["rank"] for p in profiles) == [0, 1]
    for p in profiles:
        assert p["steps"] == 3 and p["step_s"] > 0
        for name in phases:
            assert p["phases"][name] > 0, (name, p)
        absent = set(profiling.PHASES) - set(phases) - {"engine_queue", "device_pack"}
        assert all(p["phases"][name] == 0 for name in absent), p
        # Op time on TensorFlow's threads fits in the step's wall time on each thread.
        on_tf = sum(p["phases"][n] for n in profiling.PHASES
                    if n not in ("wire", "engine_queue"))
        assert on_tf < 3 * p["step_s"], p
