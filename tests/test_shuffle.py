"""Shuffled input: every rank slices the same global batches, so across ranks every sample is
trained on exactly once per epoch, in the order one process trains in when seeded as rank 0
(keras.utils.set_random_seed); unseeded, orders differ between epochs.

Two shufflers: ``fit(x, y, shuffle=True)`` on arrays permutes the samples; ``fit(py_dataset)``
(a keras.utils.PyDataset, shuffled by default) permutes its batches, served by the generator
or, with ``workers=2``, by Keras' enqueuer. Real jobs at P=2 and P=3
(tests/workers/shuffle_ids.py) record the sample ids each rank's train step receives; the same
worker in plain Keras, one process, gives the order to match. Seeded, one process draws the
arrays' permutation once and repeats it in every epoch and every fit (Keras traces it under the
global seed), and the PyDataset's orders from Python's ``random``, anew in every pass.

A tf.data pipeline shuffles itself: seeded alike on every rank it trains like the others and
like one process; fit refuses one that shuffles (or samples from datasets) without a seed,
with seeds that differ between the ranks, or with a step whose order is not deterministic, on
every rank with a message (the same jobs, after the other sources).

In this process (the fast tier): the seeds and orders data.py agrees on, against Keras' own
shuffles, with rank 0's broadcast stood in for by the identity.
"""

import json
import random
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.trainers.data_adapters import array_data_adapter

from multirank import check, run_job
from tf_poseidon import data

SAMPLES = 96
GLOBAL_BATCH = 16
SOURCES = ("arrays", "pydataset", "pydataset_threads")
FITS = ("unseeded", "seeded", "seeded_again", "seeded_next")


SEEDED = ("seeded", "seeded_again", "seeded_next")


@pytest.fixture(autouse=True)
def random_state_kept():
    """The fast tests seed TensorFlow, numpy and Python as a script would; the process's
    random state is put back after each (no global TensorFlow seed, as the suite runs)."""
    python, numpy = random.getstate(), np.random.get_state()
    yield
    random.setstate(python)
    np.random.set_state(numpy)
    tf.random.set_seed(None)


def arrays_epoch(seed: int | None = None) -> list[int]:
    """One epoch of Keras' shuffled dataset of SAMPLES ids, built now (under ``seed``, as a
    graph seed, where given)."""
    def build():
        return array_data_adapter.ArrayDataAdapter(
            np.arange(SAMPLES), batch_size=GLOBAL_BATCH, shuffle=True).get_tf_dataset()
    if seed is None:
        dataset = build()
    else:
        with data.tracing_seed(seed):
            dataset = build()
    return [int(i) for batch in dataset for i in batch]


def test_seeded_the_arrays_permutation_is_the_one_process_draws_in_every_epoch():
    keras.utils.set_random_seed(11)
    one_process = arrays_epoch()
    seeds = data.agreed_permutation_seeds(lambda rank0: rank0)
    keras.utils.set_random_seed(12)  # another rank's seed; rank 0's decided above
    epochs = [arrays_epoch(next(seeds)) for _ in range(3)]
    assert sorted(one_process) == list(range(SAMPLES)) != one_process
    assert epochs == [one_process] * 3


def test_unseeded_the_arrays_permutation_is_new_every_epoch_and_the_same_on_every_rank():
    tf.random.set_seed(None)
    decided = []  # rank 0's values: the first rank's, here

    def broadcast_from_rank0(value):
        decided.append(value)
        return decided[0]
    ranks = [data.agreed_permutation_seeds(broadcast_from_rank0) for _ in range(2)]
    epochs = [[arrays_epoch(next(seeds)) for _ in range(3)] for seeds in ranks]
    assert epochs[0] == epochs[1]
    assert len({tuple(epoch) for epoch in epochs[0]}) == 3


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 6

    def __getitem__(self, index):
        return np.full((2, 1), index), np.zeros((2, 1))


def test_a_pydatasets_orders_are_keras_shuffles_from_rank0s_random():
    random.seed(5)
    expected = []
    for _ in range(3):  # Keras' own: a shuffle of the batch indices per pass
        expected.append(list(range(6)))
        random.shuffle(expected[-1])
    after = random.getstate()
    random.seed(5)
    generator = data.agreed_python_random(lambda rank0: rank0)
    random.seed(6)  # another rank's state; rank 0's decided above
    ordered = data.AgreedBatchOrder(Batches(), generator)
    passes = []
    for _ in range(3):
        ordered.begin_pass()
        passes.append([int(ordered[i][0][0, 0]) for i in range(len(ordered))])
    assert passes == expected
    assert random.getstate() == after


def global_orders(out, ranks, fit):
    """Per epoch, the ids of the epoch in training order: step by step, ranks in rank order."""
    per_rank = [json.loads((out / f"rank{r}.json").read_text())[fit] for r in range(ranks)]
    orders = []
    for epoch in range(len(per_rank[0])):
        steps = [per_rank[r][epoch] for r in range(ranks)]
        assert len({len(s) for s in steps}) == 1, "ranks ran different numbers of steps"
        order = []
        for step in range(len(steps[0])):
            batch = [i for r in range(ranks) for i in steps[r][step]]
            assert len(batch) == GLOBAL_BATCH
            order += batch
        orders.append(order)
    return orders


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """World size -> the job's output directory; world size 1: plain Keras, one process."""
    done = {}
    for ranks in (1, 2, 3):
        out = done[ranks] = tmp_path_factory.mktemp(f"shuffle_p{ranks}")
        job = (0, "shuffle_ids.py", str(out), "--one-process") if ranks == 1 else (
            ranks, "shuffle_ids.py", str(out))
        check(run_job(*job)[0])
    return done


@pytest.mark.multirank
@pytest.mark.parametrize("source", SOURCES)
def test_every_rank_slices_the_same_order_as_one_process(jobs, source):
    one_process = {fit: global_orders(jobs[1], 1, f"{source}/{fit}") for fit in SEEDED}
    for ranks in (2, 3):
        orders = {fit: global_orders(jobs[ranks], ranks, f"{source}/{fit}") for fit in FITS}
        for fit, epochs in orders.items():
            assert len(epochs) == 2
            for order in epochs:
                # Disjoint across ranks and steps, and together the whole set.
                assert sorted(order) == list(range(SAMPLES)), (ranks, fit)
                assert order != list(range(SAMPLES)), (ranks, fit)
                if source != "arrays":
                    # Every step's rows are one of the PyDataset's global batches, whole.
                    steps = [order[i:i + GLOBAL_BATCH] for i in range(0, SAMPLES, GLOBAL_BATCH)]
                    assert all(step == list(range(step[0], step[0] + GLOBAL_BATCH))
                               for step in steps), (ranks, fit, steps)
        assert orders["unseeded"][0] != orders["unseeded"][1], (ranks, "same order twice")
        for fit in SEEDED:  # rank 0's seed decides: the other ranks seed differently
            assert orders[fit] == one_process[fit], (ranks, fit)
    if source == "arrays":
        assert all(epochs == [one_process["seeded"][0]] * 2 for epochs in one_process.values())
    else:
        assert all(epochs[0] != epochs[1] for epochs in one_process.values())
        assert one_process["seeded"] == one_process["seeded_again"] != one_process["seeded_next"]


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", ["seeded", "op_seed"])
def test_a_dataset_seeded_alike_gives_every_rank_the_same_order_as_one_process(jobs, scenario):
    one_process = global_orders(jobs[1], 1, f"dataset/{scenario}")
    for ranks in (2, 3):
        epochs = global_orders(jobs[ranks], ranks, f"dataset/{scenario}")
        assert len(epochs) == 2 and epochs[0] != epochs[1], ranks
        for order in epochs:
            assert sorted(order) == list(range(SAMPLES)) and order != list(range(SAMPLES))
        assert epochs == one_process, ranks


@pytest.mark.multirank
@pytest.mark.parametrize("scenario, message", [
    ("unseeded", r"^tf_poseidon: the input pipeline shuffles without a seed .* Pass a seed "
                 r"\(dataset\.shuffle\(n, seed=\.\.\.\)\), or call "
                 r"keras\.utils\.set_random_seed"),
    ("sampled", r"^tf_poseidon: the input pipeline shuffles without a seed \(Dataset\.shuffle, "
                r"or Dataset\.sample_from_datasets or Dataset\.random, with no seed"),
    ("unordered", r"^tf_poseidon: the input pipeline yields its elements in no fixed order "
                  r"\(Dataset\.map: deterministic=False, sloppy=True or tf\.data\.Options\."
                  r"deterministic = False\): every rank would read them in an order of its own"),
    ("different", r"^tf_poseidon: the ranks were given different data \(rank 0: [^;]*, "
                  r"shuffled with seeds \[\(5, \d+\)\]; rank 1: [^;]*, shuffled with seeds "
                  r"\[\(6, \d+\)\](; rank 2: [^;]*, shuffled with seeds \[\(7, \d+\)\])?\)\."
                  r".*shuffled with the same seed \(here the seeds differ: pass the same "
                  r"seed to every shuffle, or call keras\.utils\.set_random_seed\(\.\.\.\) "
                  r"with the same seed on every rank")])
def test_a_dataset_that_would_shuffle_differently_on_each_rank_is_refused(jobs, scenario,
                                                                           message):
    for ranks in (2, 3):
        for rank in range(ranks):
            fit = json.loads((jobs[ranks] / f"rank{rank}.json").read_text())[
                f"dataset/{scenario}"]
            assert isinstance(fit, dict), (ranks, rank, "fit trained")
            assert re.search(message, fit["error"], re.S), fit["error"]
