"""fit(shuffle=True) on arrays: every rank slices the same permutation, so across ranks every
sample is trained on exactly once per epoch; permutations differ between epochs and repeat for
runs seeded alike by rank 0 (keras.utils.set_random_seed).

Real jobs at P=2 and P=3 (tests/workers/shuffle_ids.py) record the sample ids each rank's train
step receives.
"""

import json

import pytest

from multirank import check, run_job

SAMPLES = 96
GLOBAL_BATCH = 16


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


@pytest.mark.multirank
def test_every_rank_slices_the_same_permutation(tmp_path):
    seeded = {}
    for ranks in (2, 3):
        out = tmp_path / f"p{ranks}"
        out.mkdir()
        check(run_job(ranks, "shuffle_ids.py", str(out))[0])
        orders = {fit: global_orders(out, ranks, fit)
                  for fit in ("unseeded", "seeded", "seeded_again", "seeded_next")}
        for fit, epochs in orders.items():
            assert len(epochs) == 2
            for order in epochs:
                # Disjoint across ranks and steps, and together the whole set.
                assert sorted(order) == list(range(SAMPLES)), (ranks, fit)
                assert order != list(range(SAMPLES)), (ranks, fit)
            assert epochs[0] != epochs[1], (ranks, fit, "same permutation in both epochs")
        assert orders["seeded"] == orders["seeded_again"], ranks
        assert orders["seeded_next"] != orders["seeded"], ranks
        seeded[ranks] = orders["seeded"]
    # The permutation is rank 0's choice alone: the same global order whatever the world size.
    assert seeded[2] == seeded[3]
