"""A model's own train_step/test_step, compile(jit_compile=True) and the *_on_batch methods at
P=2 vs one process.

tests/workers/keras_steps.py trains each configuration in one job per world size (even global
batches: the guide's step averages its loss over the local rows, which is the global mean only
when the ranks' shares are equal).
"""

import os

import numpy as np
import pytest

from multirank import check, run_job

TOLERANCE = 1e-5
CONFIGS = ("guide,guide-xla,guide-draws,guide-bn,cnn-xla,cnn-augmented,stateful,retrieval,"
           "gan,augmenting-layers,on-batch")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    single = tmp_path_factory.mktemp("p1")
    # Plain Keras (no strategy) is the reference of the configurations named <config>-keras.
    check(run_job(0, "keras_steps.py", str(single),
                  CONFIGS + ",cnn-plain,cnn-augmented-keras,gan-keras,augmenting-layers-keras,"
                  "on-batch-keras")[0])
    two = tmp_path_factory.mktemp("p2")
    dump = tmp_path_factory.mktemp("xla")
    check(run_job(2, "keras_steps.py", str(two),
                  CONFIGS + ",on-batch-mismatch,on-batch-easgd,stateful-rank-batch",
                  env={"KERAS_STEPS_XLA_DUMP": str(dump)})[0])
    return single, two, dump


def load(out, config, rank):
    return np.load(out / f"{config}_rank{rank}.npz")


def max_difference(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.multirank
@pytest.mark.parametrize("config", ["guide", "guide-xla", "guide-draws"])
def test_custom_train_step_metrics_are_global(jobs, config):
    single, two, _ = jobs
    reference = load(single, config, 0)
    for rank in range(2):
        result = load(two, config, rank)
        for key in ("weights", "accuracy", "batch_accuracy", "predictions"):
            assert max_difference(reference[key], result[key]) <= TOLERANCE, (rank, key)
        # The accuracy evaluate's own test_step reports.
        assert max_difference(reference["evaluation"][1], result["evaluation"][1]) <= TOLERANCE
        # Keras divides a loss computed in a replica context by the number of replicas (so that
        # summed gradients are the mean); the step's loss metric, fed that loss, is global and
        # shows the mean loss / P, as under TensorFlow's own strategies.
        assert max_difference(reference["loss"], 2 * result["loss"]) <= TOLERANCE, rank
        assert max_difference(reference["evaluation"][0], 2 * result["evaluation"][0]) \
            <= TOLERANCE, rank
        # Fed loss · P weighted by the step's rows, as docs/synchronization.md shows, a loss
        # metric reports one process's loss.
        assert max_difference(reference["loss"], result["unscaled_loss"]) <= TOLERANCE, rank


@pytest.mark.multirank
def test_custom_train_step_synchronizes_batchnorm_state(jobs):
    # A subclass's train_step replaces Keras' own, and with it anything wrapped there: the
    # moving statistics must still be combined after every step. The BN layer normalizes the
    # input, so its moving mean is the same exponential average of the global batches' means as
    # in one process (the ranks' row-weighted average of their local moving means is that
    # average only if it is taken after every step). Each rank's model, called on the predicted
    # rows without any communication, gives what rank 0's gives: the same statistics.
    single, two, _ = jobs
    reference = load(single, "guide-bn", 0)
    first = load(two, "guide-bn", 0)
    assert first["moving_mean"].size
    for rank in range(2):
        result = load(two, "guide-bn", rank)
        difference = max_difference(reference["moving_mean"], result["moving_mean"])
        assert difference <= TOLERANCE, (rank, difference)
        assert np.isfinite(result["non_trainable"]).all(), rank
    second = load(two, "guide-bn", 1)
    for key in ("weights", "non_trainable", "own_predictions"):
        assert max_difference(first[key], second[key]) == 0.0, key


@pytest.mark.multirank
def test_jit_compile_matches_one_process_with_xla(jobs):
    single, two, dump = jobs
    reference = load(single, "cnn-xla", 0)
    # The scale: XLA alone moves one process's weights by less than the tolerance (2e-7 here).
    assert max_difference(reference["weights"], load(single, "cnn-plain", 0)["weights"]) \
        <= TOLERANCE
    for rank in range(2):
        result = load(two, "cnn-xla", rank)
        for key in ("weights", "loss", "accuracy", "batch_accuracy", "evaluation",
                    "predictions"):
            assert max_difference(reference[key], result[key]) <= TOLERANCE, (rank, key)
    # XLA compiled the backward pass at P=2: a cluster (of the jit scope; Keras' own
    # jit-compiled functions are named after the function) holds the convolution and the
    # max-pooling gradient (select-and-scatter).
    compiled = []
    for name in os.listdir(dump / "rank0"):
        if ".cluster_" in name and name.endswith("before_optimizations.txt"):
            text = (dump / "rank0" / name).read_text()
            compiled.append("convolution(" in text and "select-and-scatter(" in text)
    assert any(compiled), f"no XLA cluster holds the backward pass ({len(compiled)} clusters)"


@pytest.mark.multirank
def test_a_stateful_rnn_built_as_in_one_process_trains_like_one_process(jobs):
    # Built for the global batch of 75 rows, as in one process, each rank's LSTM keeps the
    # states of its rows of every global batch (37 and 38: states of different shapes on the
    # two ranks): one process's states for those rows, across fit, evaluate and predict, and
    # the weights, losses and predictions are one process's. The exported model holds the
    # whole batch's states, as one process's does: serving it twice (the second call goes on
    # from the first's states) gives one process's outputs.
    single, two, _ = jobs
    reference = load(single, "stateful", 0)
    starts = [0, 37, 75]
    for rank in range(2):
        result = load(two, "stateful", rank)
        for key in ("weights", "loss", "accuracy", "evaluation", "predictions"):
            assert max_difference(reference[key], result[key]) <= TOLERANCE, (rank, key)
        rows = reference["states"][starts[rank]:starts[rank + 1]]
        assert rows.shape == result["states"].shape, (rank, result["states"].shape)
        assert max_difference(rows, result["states"]) <= TOLERANCE, rank
    served = load(two, "stateful", 0)["served"]
    assert served.shape == (2, 75, 3) and max_difference(served[0], served[1]) > 1e-3
    assert max_difference(reference["served"], served) <= TOLERANCE


@pytest.mark.multirank
def test_a_stateful_rnn_built_for_the_ranks_share_is_refused_naming_the_global_batch(jobs):
    _, two, _ = jobs
    for rank in range(2):
        message = str(load(two, "stateful-rank-batch", rank)["message"])
        # The job's second LSTM: Keras names it lstm_1 (and adds its own lines around this).
        assert (
            "tf_poseidon: the stateful RNN 'lstm_1' was built for a batch of 37 rows, which is "
            f"the global batch: rank {rank} of 2 holds the states of {18 + rank} of them, but "
            f"its input here has {37 + rank} rows.") in message, message
        assert "build the model for the global batch (keras.Input(batch_size=B))" in message


@pytest.mark.multirank
def test_in_batch_negatives_gathered_from_every_rank_train_like_one_process(jobs):
    # Each rank's loss scores its queries against every rank's items: the item tower's
    # gradient comes from every rank's loss, through all_gather's gradient.
    single, two, _ = jobs
    reference = load(single, "retrieval", 0)
    assert max_difference(reference["weights"], reference["initial"]) > 0.1  # it trained
    for rank in range(2):
        result = load(two, "retrieval", rank)
        assert max_difference(reference["weights"], result["weights"]) <= TOLERANCE, rank


@pytest.mark.multirank
@pytest.mark.parametrize("config", ["cnn-augmented", "augmenting-layers"])
def test_augmentation_trains_like_plain_keras(jobs, config):
    # cnn-augmented: every rank runs the pipeline (RandomFlip mapped over the global batches,
    # drawing from its seed generator's state, then a stateless map and a prefetch) and takes
    # its rows: plain Keras' batches, provided no rank pulls an element plain Keras does not
    # (Keras under a strategy peeks at a batch before fit's first epoch; tf_poseidon builds
    # from the spec). augmenting-layers: each layer of the model draws its transformation per
    # image, each rank its rows of one process's draw.
    single, two, _ = jobs
    reference = load(single, f"{config}-keras", 0)
    assert max_difference(reference["weights"], load(single, "cnn-plain", 0)["weights"]) > 0.01
    for out, rank in ((single, 0), (two, 0), (two, 1)):
        result = load(out, config, rank)
        for key in ("weights", "loss", "accuracy", "batch_accuracy", "evaluation",
                    "predictions"):
            assert max_difference(reference[key], result[key]) <= TOLERANCE, (out, rank, key)


@pytest.mark.multirank
def test_the_guides_gan_trains_like_plain_keras(jobs):
    # A model with no call() (Keras under a strategy could not build it: "Unable to
    # automatically build the model"), two optimizers, latent vectors and label noise drawn by
    # rows. The losses the step reports are local means / P, as under TensorFlow's strategies.
    single, two, _ = jobs
    reference = load(single, "gan-keras", 0)
    for out, rank, ranks in ((single, 0, 1), (two, 0, 2), (two, 1, 2)):
        result = load(out, "gan", rank)
        assert max_difference(reference["weights"], result["weights"]) <= TOLERANCE, (ranks, rank)
        for key in ("d_loss", "g_loss"):
            assert max_difference(reference[key], ranks * result[key]) <= TOLERANCE, (ranks, key)


@pytest.mark.multirank
def test_on_batch_methods_take_the_global_batch_like_plain_keras(jobs):
    # train_on_batch, test_on_batch and predict_on_batch take the global batch on every rank, as
    # fit does: each rank runs its rows (24 and 25 of 49), its Dropout masks one process's for
    # them, and class weights apply to its rows; predict_on_batch returns the batch's rows.
    single, two, _ = jobs
    reference = load(single, "on-batch-keras", 0)
    for out, rank in ((single, 0), (two, 0), (two, 1)):
        result = load(out, "on-batch", rank)
        assert result["predictions"].shape == (49, 3), (out, rank)
        for key in ("weights", "loss", "accuracy", "evaluation", "predictions"):
            assert max_difference(reference[key], result[key]) <= TOLERANCE, (out, rank, key)


@pytest.mark.multirank
def test_test_and_predict_on_batch_give_evaluate_and_predict_results_under_easgd(jobs):
    # EASGD's ranks are not in lockstep: their steps' metrics are each rank's own, and
    # evaluate and predict use the center variables. test_on_batch and predict_on_batch give
    # what evaluate and predict give for the same rows, on every rank.
    _, two, _ = jobs
    first = load(two, "on-batch-easgd", 0)
    assert max_difference(first["weights"], load(two, "on-batch-easgd", 1)["weights"]) > 1e-4
    for rank in range(2):
        result = load(two, "on-batch-easgd", rank)
        assert max_difference(result["evaluation"], result["evaluated"]) <= TOLERANCE, rank
        assert max_difference(result["predictions"], result["predicted"]) <= TOLERANCE, rank
        assert max_difference(result["evaluation"], first["evaluated"]) <= TOLERANCE, rank


@pytest.mark.multirank
def test_on_batch_methods_refuse_different_batches_on_the_ranks(jobs):
    _, two, _ = jobs
    for rank in range(2):
        message = str(load(two, "on-batch-mismatch", rank)["message"])
        assert "train_on_batch different batches (of the same shapes, (49, 8, 8, 1), (49,); " \
               "other values)" in message, message
        assert "seed NumPy alike on every rank" in message, message
