"""Shuffled input: every rank slices the same global batches, so across ranks every sample is
trained on exactly once per epoch; orders differ between epochs and repeat for runs seeded
alike by rank 0 (keras.utils.set_random_seed).

Two shufflers: ``fit(x, y, shuffle=True)`` on arrays permutes the samples; ``fit(py_dataset)``
(a keras.utils.PyDataset, shuffled by default) permutes its batches, served by the generator
or, with ``workers=2``, by Keras' enqueuer. Real jobs at P=2 and P=3
(tests/workers/shuffle_ids.py) record the sample ids each rank's train step receives.

A tf.data pipeline shuffles itself: seeded alike on every rank it trains like the others; fit
refuses one that shuffles without a seed, or with seeds that differ between the ranks, on
every rank with a message (the same jobs, after the other sources).
"""

import json
import re

import pytest

from multirank import check, run_job

SAMPLES = 96
GLOBAL_BATCH = 16
SOURCES = ("arrays", "pydataset", "pydataset_threads")
FITS = ("unseeded", "seeded", "seeded_again", "seeded_next")


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
    """World size -> the job's output directory."""
    done = {}
    for ranks in (2, 3):
        out = done[ranks] = tmp_path_factory.mktemp(f"shuffle_p{ranks}")
        check(run_job(ranks, "shuffle_ids.py", str(out))[0])
    return done


@pytest.mark.multirank
@pytest.mark.parametrize("source", SOURCES)
def test_every_rank_slices_the_same_order(jobs, source):
    seeded = {}
    for ranks, out in jobs.items():
        orders = {fit: global_orders(out, ranks, f"{source}/{fit}") for fit in FITS}
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
            assert epochs[0] != epochs[1], (ranks, fit, "same order in both epochs")
        assert orders["seeded"] == orders["seeded_again"], ranks
        assert orders["seeded_next"] != orders["seeded"], ranks
        seeded[ranks] = orders["seeded"]
    # The order is rank 0's choice alone: the same global order whatever the world size.
    assert seeded[2] == seeded[3]


@pytest.mark.multirank
@pytest.mark.parametrize("scenario", ["seeded", "op_seed"])
def test_a_dataset_seeded_alike_gives_every_rank_the_same_order(jobs, scenario):
    for ranks, out in jobs.items():
        epochs = global_orders(out, ranks, f"dataset/{scenario}")
        assert len(epochs) == 2 and epochs[0] != epochs[1], ranks
        for order in epochs:
            assert sorted(order) == list(range(SAMPLES)) and order != list(range(SAMPLES))


@pytest.mark.multirank
@pytest.mark.parametrize("scenario, message", [
    ("unseeded", r"^tf_poseidon: the input pipeline shuffles without a seed .* Pass a seed "
                 r"\(dataset\.shuffle\(n, seed=\.\.\.\)\), or call "
                 r"keras\.utils\.set_random_seed"),
    ("different", r"^tf_poseidon: the ranks were given different data \(rank 0: [^;]*, "
                  r"shuffled with seeds \[\(5, \d+\)\]; rank 1: [^;]*, shuffled with seeds "
                  r"\[\(6, \d+\)\](; rank 2: [^;]*, shuffled with seeds \[\(7, \d+\)\])?\)\."
                  r".*shuffled with the same seed")])
def test_a_dataset_that_would_shuffle_differently_on_each_rank_is_refused(jobs, scenario,
                                                                           message):
    for ranks, out in jobs.items():
        for rank in range(ranks):
            fit = json.loads((out / f"rank{rank}.json").read_text())[f"dataset/{scenario}"]
            assert isinstance(fit, dict), (ranks, rank, "fit trained")
            assert re.search(message, fit["error"], re.S), fit["error"]
