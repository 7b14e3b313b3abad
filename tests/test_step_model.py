"""sacp/step_model.py: the layers of a Keras model, the bytes of each protocol by the cost
model's formulas, the schedule's limits (no communication: the compute; naive: compute
plus every message; overlap never slower than naive) and ranks sharing cores."""

import dataclasses
import math

import keras
import pytest

from tf_poseidon.sacp import step_model

FAST = step_model.Machine(bandwidth_bytes_s=math.inf, latency_s=0.0, flops_s=math.inf,
                          convert_bytes_s=math.inf)
LINK = step_model.Machine(bandwidth_bytes_s=1e8, latency_s=1e-4, flops_s=1e10,
                          convert_bytes_s=1e9)


def mlp():
    return keras.Sequential([keras.Input((100,)), keras.layers.Dense(300),
                             keras.layers.Dense(10)])


def test_layers_of_a_model():
    layers = step_model.layers_of(mlp())
    assert [(l.elements, l.matrix, l.sfb_rows) for l in layers] == [
        (30000, (100, 300), 1), (300, None, 0), (3000, (300, 10), 1), (10, None, 0)]
    kernel, bias = layers[0], layers[1]
    assert kernel.flops + bias.flops == pytest.approx(2 * 100 * 300)
    conv = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, padding="same")])
    [kernel, _] = step_model.layers_of(conv)
    assert kernel.matrix == (27, 4) and kernel.sfb_rows == 0
    # 2 flops per kernel element and output position, the kernel's share by elements.
    assert kernel.flops == pytest.approx(2 * 108 * 64 * 108 / (108 + 4))


@pytest.mark.parametrize("ranks", [2, 4])
def test_bytes_follow_the_cost_model(ranks):
    layers, p = step_model.layers_of(mlp()), ranks
    elements = 30000 + 300 + 3000 + 10
    ring = 2 * (p - 1) / p
    assert step_model.estimate(layers, "allreduce", p, 8, 1.0, LINK).bytes_per_rank == \
        pytest.approx(ring * elements * 4)
    assert step_model.estimate(layers, "fp16", p, 8, 1.0, LINK).bytes_per_rank == \
        pytest.approx(ring * elements * 2)
    sfb = step_model.estimate(layers, "sfb", p, 8, 1.0, LINK).bytes_per_rank
    # The 100x300 kernel by SFB ((P-1)·K·(M+N)·4), the rest all-reduced.
    assert sfb == pytest.approx((p - 1) * 8 * 400 * 4 + ring * (300 + 3000 + 10) * 4)


def test_schedule_limits():
    layers = step_model.layers_of(mlp())
    for protocol in step_model.PROTOCOLS:
        assert step_model.estimate(layers, protocol, 4, 8, 0.5, FAST).step_s == \
            pytest.approx(0.5)
        naive = step_model.estimate(layers, "naive", 4, 8, 0.5, LINK)
        assert naive.step_s == pytest.approx(0.5 + naive.comm_s)
        assert step_model.estimate(layers, "allreduce", 4, 8, 0.5, LINK).step_s <= naive.step_s
    with pytest.raises(ValueError, match="protocol 'ring'"):
        step_model.estimate(layers, "ring", 2, 8, 0.5, LINK)


def test_ranks_sharing_cores_run_the_one_core_rates_slower():
    layers = step_model.layers_of(mlp())
    whole = dataclasses.replace(LINK, cores_per_rank=1.0)
    half = dataclasses.replace(LINK, cores_per_rank=0.5)
    sfb_whole, sfb_half = (step_model.estimate(layers, "sfb", 4, 8, 0.5, m) for m in (whole, half))
    # The 100x300 kernel goes by SFB either way; its reconstruction takes twice as long.
    assert sfb_half.bytes_per_rank == sfb_whole.bytes_per_rank
    assert sfb_whole.compute_s - 0.5 == pytest.approx(2 * 100 * 300 * 3 * 8 / LINK.flops_s)
    assert sfb_half.compute_s - 0.5 == pytest.approx(2 * (sfb_whole.compute_s - 0.5))
    fp16_whole, fp16_half = (step_model.estimate(layers, "fp16", 4, 8, 0.5, m)
                             for m in (whole, half))
    # Three 4-byte passes per element at half the conversion rate.
    elements = 30000 + 300 + 3000 + 10
    assert fp16_half.comm_s - fp16_whole.comm_s == \
        pytest.approx(elements * 3 * 4 / LINK.convert_bytes_s)


def test_lowrank_weighs_sfb_as_the_plan_does():
    """With lowrank= the plan takes the fastest of all-reduce, SFB and low-rank per layer: a
    slow low-rank compute leaves the Dense kernels to SFB, a fast one takes them."""
    layers, p, k = step_model.layers_of(mlp()), 4, 8
    ring = 2 * (p - 1) / p
    sfb = step_model.estimate(layers, "sfb", p, k, 1.0, LINK).bytes_per_rank
    slow = dataclasses.replace(LINK, lowrank_elements_s=1e3)
    assert step_model.estimate(layers, "lowrank", p, k, 1.0, slow).bytes_per_rank == \
        pytest.approx(sfb)
    fast = dataclasses.replace(LINK, latency_s=0.0, lowrank_elements_s=math.inf)
    # Both kernels low-rank at rank 4 (each compressed more than 2x), the biases all-reduced.
    assert step_model.estimate(layers, "lowrank", p, k, 1.0, fast).bytes_per_rank == \
        pytest.approx(ring * ((100 + 300) + (300 + 10)) * 4 * 4 + ring * (300 + 10) * 4)


def test_the_hand_over_copies_each_value_in_and_out_on_the_ranks_cores():
    layers = step_model.layers_of(mlp())
    elements = 30000 + 300 + 3000 + 10
    copying = dataclasses.replace(LINK, copy_bytes_s=1e9)
    base = step_model.estimate(layers, "naive", 4, 8, 0.5, LINK).step_s
    assert step_model.estimate(layers, "naive", 4, 8, 0.5, copying).step_s - base == \
        pytest.approx(2 * elements * 4 / 1e9)
    shared = dataclasses.replace(copying, cores_per_rank=0.5)
    assert step_model.estimate(layers, "naive", 4, 8, 0.5, shared).step_s - base == \
        pytest.approx(2 * 2 * elements * 4 / 1e9)
