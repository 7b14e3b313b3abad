"""The model zoo: real Keras models of the families users train, P ranks against one process.

One job per world size (tests/workers/model_zoo.py trains every entry of it): P=2 for all
models and variants, P=3 for most, and one process for the references. Every comparison is at
the same global batch over 10+ steps: weights (trainable and non-trainable), the optimizer's
variables, History's loss, evaluate's results, predict's outputs (gathered from every rank),
each rank's own model called on the same inputs (no communication, so a rank whose weights or
statistics differ shows it), and the outputs of the SavedModel tp.export_for_serving wrote.

Tolerances: weights, optimizer state, non-trainable state, losses and evaluate's results are
held to TOLERANCE (1e-5) absolute. Model outputs are held to TOLERANCE relative to their
magnitude (at least 1): an output is a sum over a layer's fan-in of weights times activations,
so weights that agree to float32 rounding move an output by that rounding times the sum of the
activations' magnitudes, which grows with the output (logits of magnitude 10+ of the BN CNN).
Mixed precision is compared with one process that sums each global batch's gradient from the
ranks' row slices (the worker's sliced_train_step): float16 rounds each slice's weight
gradients on its own, on every rank, which one process's whole-batch step does not.
"""

import glob

import numpy as np
import pytest

from multirank import check, run_job

pytestmark = pytest.mark.multirank

TOLERANCE = 1e-5
FP16_TOLERANCE = 2e-2
ACCURACY_POINTS = 0.01

ONE = ["bn_cnn-sync", "bn_cnn-xla", "transformer-sync", "rnn-sync", "tagger-sync",
       "tagger_sum-sync", "tagger_weighted-sync", "wide_deep-sync", "wide_deep-xla",
       "wide_deep_sgd-sync", "mp_cnn-sliced2", "mp_cnn-sliced3", "mp_mlp-sliced2",
       "mp_mlp-sliced3", "mp_cnn_bf16-sliced2", "accum-sync", "accum-xla", "accum_sgd-sync",
       "two_io-sync", "bn_mlp-sync", "stopping-sync", "pydataset-sync", "wide_deep-eager",
       "two_io-eager"]
# Models whose one-process run under the strategy is checked against plain Keras: one of each
# feature the strategy touches in one process (building, random layers, masks, sparse
# gradients, accumulation, several outputs, validation callbacks, PyDataset).
PLAIN_KERAS = ["bn_cnn", "transformer", "rnn", "tagger", "wide_deep", "accum", "two_io",
               "stopping", "pydataset"]
ONE += [f"{name}-keras" for name in PLAIN_KERAS]
TWO = ["bn_cnn-sync", "bn_cnn-sbn", "bn_cnn-xla", "bn_cnn-sbnxla", "bn_cnn-fp16", "bn_cnn-ssp",
       "bn_cnn-easgd", "transformer-sync", "transformer-always", "transformer-fp16",
       "transformer-ssp", "transformer-easgd", "rnn-sync", "tagger-sync", "tagger_sum-sync",
       "tagger_weighted-sync", "wide_deep-sync", "wide_deep-xla", "wide_deep_sgd-sync",
       "mp_cnn-sync", "mp_cnn-xla", "mp_mlp-sync", "mp_cnn_bf16-sync", "accum-sync", "accum-xla",
       "accum_sgd-sync", "two_io-sync", "bn_mlp-sync", "bn_mlp-sbn", "bn_mlp_synced-sync",
       "stopping-sync", "pydataset-sync", "wide_deep-eager", "two_io-eager", "peak_metric-sync"]
THREE = ["transformer-sync", "rnn-sync", "tagger-sync", "tagger_weighted-sync", "two_io-sync",
         "wide_deep-sync", "wide_deep_sgd-sync", "mp_cnn-sync", "mp_mlp-sync", "accum-sync",
         "accum_sgd-sync", "bn_mlp-sync", "bn_mlp-sbn", "bn_mlp_synced-sync", "stopping-sync",
         "pydataset-sync", "wide_deep-eager"]


def train(tmp_path_factory, ranks, entries):
    out = tmp_path_factory.mktemp(f"zoo_p{ranks}")
    check(run_job(ranks, "model_zoo.py", str(out), ",".join(entries), timeout=1200)[0])
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """World size (1 = one process) -> the job's output directory, each job run on first use."""
    entries = {1: ONE, 2: TWO, 3: THREE}
    done = {}

    def get(ranks):
        if ranks not in done:
            done[ranks] = train(tmp_path_factory, 0 if ranks == 1 else ranks, entries[ranks])
        return done[ranks]
    return get


def error_of(out, entry, rank=0) -> str | None:
    errors = glob.glob(str(out / f"{entry}_rank{rank}.error"))
    return open(errors[0]).read() if errors else None


def load(out, entry, rank=0):
    error = error_of(out, entry, rank)
    if error is not None:
        pytest.fail(f"{entry} failed on rank {rank}:\n" + error[-3000:])
    return np.load(out / f"{entry}_rank{rank}.npz")


def max_difference(a, b) -> float:
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b), initial=0.0))


OUTPUTS = ("predict_", "own_", "export_")


def assert_close(reference, result, keys, where, reference_keys=None):
    """Each of ``keys`` of ``result`` within TOLERANCE of the same key of ``reference`` (or of
    ``reference_keys``, in the same order): absolute, relative to the magnitude for outputs
    (module docstring). A NaN anywhere fails."""
    for key, reference_key in zip(keys, reference_keys or keys):
        expected = np.asarray(reference[reference_key], "float64")
        difference = max_difference(expected, result[key])
        scale = (max(1.0, float(np.max(np.abs(expected), initial=0.0)))
                 if key.startswith(OUTPUTS) else 1.0)
        assert difference <= TOLERANCE * scale, \
            f"{where} {key}: max |difference| {difference:.3g} (scale {scale:.3g})"


def outputs(saved, prefix):
    return sorted(k for k in saved.files if k.startswith(prefix))


def reference_entry(entry: str) -> str:
    """The one-process entry ``entry`` is compared with: the plain model (sync_batchnorm, sfb
    and BatchNormalization(synchronized=True) change nothing in one process), compiled with
    XLA or run eagerly where ``entry`` is (Keras itself weighs the per-output loss metrics of a
    last, smaller batch differently in the two: by rows where the batch size is known)."""
    name, variant = entry.split("-")
    compiled = "xla" if variant.endswith("xla") else "eager" if variant == "eager" else "sync"
    return f"{name.removesuffix('_synced')}-{compiled}"


def assert_equals_one_process(jobs, entry, ranks, reference, keys):
    """Every rank's ``keys``, each rank's own outputs and rank 0's export (rank 0 wrote it and
    ran it) against one process's ``reference`` entry: predict's outputs are the reference
    for the own and the exported ones."""
    expected = load(jobs(1), reference)
    predicted = outputs(expected, "predict_")
    for rank in range(ranks):
        result = load(jobs(ranks), entry, rank)
        own = [f"own_{k[len('predict_'):]}" for k in predicted]
        exported = [f"export_{k[len('predict_'):]}" for k in predicted] if rank == 0 else []
        assert set(exported) <= set(result.files), result.files
        assert_close(expected, result, keys + predicted + own + exported,
                     f"{entry} rank {rank}", keys + predicted * (3 if rank == 0 else 2))


EXACT = [("transformer-sync", 2), ("transformer-always", 2), ("rnn-sync", 2),
         ("tagger-sync", 2), ("tagger_sum-sync", 2), ("tagger_weighted-sync", 2),
         ("tagger-sync", 3), ("tagger_weighted-sync", 3),
         ("wide_deep-sync", 2), ("wide_deep_sgd-sync", 2), ("two_io-sync", 2),
         ("accum-sync", 2), ("accum_sgd-sync", 2), ("bn_cnn-sbn", 2), ("bn_mlp-sbn", 2),
         ("bn_mlp_synced-sync", 2), ("pydataset-sync", 2),
         ("transformer-sync", 3), ("rnn-sync", 3), ("two_io-sync", 3), ("wide_deep-sync", 3),
         ("wide_deep_sgd-sync", 3), ("accum-sync", 3), ("accum_sgd-sync", 3),
         ("bn_mlp-sbn", 3), ("bn_mlp_synced-sync", 3), ("pydataset-sync", 3)]
XLA = [("wide_deep-xla", 2), ("accum-xla", 2), ("bn_cnn-sbnxla", 2)]
EAGER = [("wide_deep-eager", 2), ("two_io-eager", 2), ("wide_deep-eager", 3)]
STATE = ["trainable", "non_trainable", "optimizer", "loss", "evaluation"]


@pytest.mark.parametrize("name", PLAIN_KERAS)
def test_one_process_under_the_strategy_trains_as_plain_keras(jobs, name):
    # Every other comparison's reference is one process under PoseidonStrategy; this ties it
    # to plain Keras without a strategy (which, for one, never pulls a batch before fit).
    reference = load(jobs(1), f"{name}-keras")
    assert_close(reference, load(jobs(1), f"{name}-sync"), list(reference.files),
                 f"{name}-sync")


@pytest.mark.parametrize("entry,ranks", EXACT + XLA + EAGER)
def test_sync_training_equals_one_process(jobs, entry, ranks):
    # sfb only changes how gradients travel and sync_batchnorm / synchronized=True make BN
    # exact (bn_mlp: ranks without rows in the last batch of every epoch); compile with
    # jit_compile=True or run_eagerly=True is compared with one process compiled so too
    # (wide_deep-eager: ranks without rows in an eager step record no NaN loss).
    assert_equals_one_process(jobs, entry, ranks, reference_entry(entry), STATE)


@pytest.mark.parametrize("ranks", [2, 3])
def test_callbacks_on_validation_metrics_act_as_in_one_process(jobs, ranks):
    # ReduceLROnPlateau and EarlyStopping(restore_best_weights=True) read val_loss, which
    # every rank computes from the sum over ranks of the metric's state (the last validation
    # batch split unevenly): every rank lowers the learning rate at one process's epochs,
    # stops after as many epochs and restores the same epoch's weights.
    reference = load(jobs(1), "stopping-sync")
    epochs, rates = len(reference["loss"]), list(reference["learning_rates"])
    assert rates[-1] < rates[0], f"ReduceLROnPlateau never acted: {rates}"
    assert epochs < 40, "EarlyStopping never stopped training"
    assert reference["best_epoch"] < epochs - 1, "the restored weights are the last epoch's"
    for rank in range(ranks):
        result = load(jobs(ranks), "stopping-sync", rank)
        assert len(result["loss"]) == epochs, f"rank {rank}: {len(result['loss'])} epochs"
        assert list(result["learning_rates"]) == rates, f"rank {rank}"
        assert result["best_epoch"] == reference["best_epoch"], f"rank {rank}"
    assert_equals_one_process(jobs, "stopping-sync", ranks, "stopping-sync",
                              STATE + ["val_loss"])


@pytest.mark.parametrize("name,ranks", [("mp_cnn", 2), ("mp_cnn", 3), ("mp_mlp", 2),
                                        ("mp_mlp", 3), ("mp_cnn_bf16", 2)])
def test_mixed_precision_equals_one_process_summing_the_ranks_slices(jobs, name, ranks):
    # The loss scale, its agreed finite check and the batch-share weighting of an uneven
    # (mp_cnn) or empty (mp_mlp) last batch leave nothing but float16's (bfloat16's, without
    # a loss scale) rounding of each slice's weight gradients, which one process summing the
    # same slices rounds alike.
    assert_equals_one_process(jobs, f"{name}-sync", ranks, f"{name}-sliced{ranks}",
                              ["trainable", "optimizer", "evaluation"])


def test_mixed_precision_with_xla_is_refused(jobs):
    for rank in range(2):
        error = error_of(jobs(2), "mp_cnn-xla", rank)
        assert error is not None and "jit_compile=True" in error and "float16" in error, error


def test_a_metric_state_without_aggregation_is_refused_naming_it(jobs):
    # wide_deep's RankAgnostic metric checks "sum", "mean" and "only_first_replica" state
    # against one process (evaluation, in test_sync_training_equals_one_process).
    for rank in range(2):
        error = error_of(jobs(2), "peak_metric-sync", rank)
        assert error is not None and "ValueError: tf_poseidon: metric 'peak' keeps its state in " \
            "variable 'peak_value' with aggregation='none'" in error, error


BATCHNORM_LOCAL = [("bn_cnn-sync", 2), ("bn_cnn-xla", 2), ("bn_mlp-sync", 2), ("bn_mlp-sync", 3)]


@pytest.mark.parametrize("entry,ranks", BATCHNORM_LOCAL)
def test_batchnorm_with_local_statistics_keeps_ranks_identical(jobs, entry, ranks):
    # Each rank normalizes with its own rows' statistics and the moving statistics are
    # combined after every step, weighted by rows (bn_mlp: a rank without rows weighs nothing,
    # its NaN batch moments never reach the model). Every rank reads its own variables and
    # calls its own model: both must be rank 0's, and rank 0's export must be every rank's
    # model.
    first = load(jobs(ranks), entry, 0)
    export = outputs(first, "export_")
    assert export and all(np.isfinite(first[k]).all() for k in export)
    for rank in range(ranks):
        result = load(jobs(ranks), entry, rank)
        assert np.isfinite(result["non_trainable"]).all(), f"rank {rank}: NaN statistics"
        if rank:
            for key in ("trainable", "non_trainable", "optimizer"):
                assert max_difference(first[key], result[key]) == 0.0, (rank, key)
        own = [f"own_{k[len('export_'):]}" for k in export]
        assert_close(first, result, own, f"{entry} rank {rank}", export)


@pytest.mark.parametrize("entry", ["bn_cnn-sync", "bn_cnn-xla"])
def test_batchnorm_with_local_statistics_trains_like_one_process(jobs, entry):
    # Normalized with each rank's own statistics, not one process's, training is close, not
    # equal: accuracy on held-out digits within one point of one process (compiled alike).
    reference = load(jobs(1), reference_entry(entry))
    accuracy = reference["evaluation"][0]  # evaluation is sorted by name: accuracy, loss
    assert accuracy > 0.9
    for rank in range(2):
        result = load(jobs(2), entry, rank)
        assert abs(result["evaluation"][0] - accuracy) <= ACCURACY_POINTS, rank


@pytest.mark.parametrize("ranks", [2, 3])
def test_batchnorm_moving_mean_of_the_input_equals_one_process(jobs, ranks):
    # The first BN layer normalizes the input features: its moving mean is the row-weighted
    # average of the ranks' moving means, which is one process's exponential average of the
    # global batches' means, also when a rank has no rows (its NaN mean weighs nothing).
    reference = load(jobs(1), "bn_mlp-sync")
    for rank in range(ranks):
        assert_close(reference, load(jobs(ranks), "bn_mlp-sync", rank),
                     ["input_norm_moving_mean"], f"rank {rank}")


@pytest.mark.parametrize("entry,ranks", [("wide_deep-sync", 2), ("wide_deep_sgd-sync", 2),
                                         ("wide_deep-sync", 3), ("wide_deep_sgd-sync", 3)])
def test_embeddings_travel_as_sparse_rows(jobs, entry, ranks):
    # The exactness above holds for the optimizer's sparse update only if the rows arrive as
    # IndexedSlices: the plan must have chosen sparse rows for both tables. The ids repeat
    # within every full global batch, so the sparse update applied each repeat.
    result = load(jobs(ranks), entry)
    embeddings = [row for row in result["plan"] if "embedding" in row]
    assert len(embeddings) == 2 and all(row.endswith(" sparse") for row in embeddings), \
        result["plan"]
    assert (result["repeated_ids"][:-1] > 0).all(), result["repeated_ids"]


def plan_rows(saved) -> dict:
    """Variable path -> (choice, reason)."""
    return {row.split(" ")[0]: (row.split(" ")[1], reason)
            for row, reason in zip(saved["plan"], saved["plan_reason"])}


def test_small_embedding_is_all_reduced(jobs):
    # The Transformer's Embedding(40, 16) looks up 12 rows per example: all-reducing the whole
    # table moves fewer bytes than gathering every lookup's row.
    rows = plan_rows(load(jobs(2), "transformer-sync"))
    embedding = [row for kernel, row in rows.items() if "embedding" in kernel]
    assert embedding == [("allreduce", "the dense all-reduce moves fewer bytes than every "
                                       "lookup's row")], rows


def test_an_embedding_is_sent_as_rows_to_an_optimizer_that_applies_them_one_by_one(jobs):
    # The tagger's Embedding(60, 8) would cost fewer bytes all-reduced, but Keras' Adam squares
    # each looked-up row on its own: the dense sum would change its update (weights 0.12 away
    # from one process after 11 steps). SGD (the tagger_sum entry) takes the cheaper dense sum.
    for entry, expected in [("tagger-sync", ("sparse", "the optimizer applies each looked-up "
                             "row on its own (its update of the dense sum would differ from one "
                             "process's)")),
                            ("tagger_sum-sync", ("allreduce", "the dense all-reduce moves fewer "
                                                 "bytes than every lookup's row"))]:
        rows = plan_rows(load(jobs(2), entry))
        assert [row for kernel, row in rows.items() if "embedding" in kernel] == [expected], rows


def test_sfb_always_sends_the_2d_head_and_refuses_3d_dense(jobs):
    # sfb="always": the classification head (2-D input) travels as sufficient factors; the
    # Dense layers on 3-D inputs cannot (K would be batch x sequence), said in the plan.
    rows = plan_rows(load(jobs(2), "transformer-always"))
    assert rows["label/kernel"] == ("sfb", "sfb='always'"), rows
    refused = [row for kernel, row in rows.items() if kernel.startswith("dense")]
    assert len(refused) == 2 and all(
        choice == "allreduce" and reason.startswith("input has 3 dimensions")
        for choice, reason in refused), rows


def test_eager_steps_all_reduce_dense_kernels_saying_why(jobs):
    # SFB's factors are captured while a step is traced; a step run eagerly all-reduces every
    # Dense kernel, and the plan says why.
    rows = plan_rows(load(jobs(2), "wide_deep-eager"))
    dense = [row for kernel, row in rows.items() if kernel.startswith("dense")]
    assert dense and all(row == ("allreduce", "the step runs eagerly (run_eagerly=True): "
                                 "factors are captured in traced steps") for row in dense), rows


@pytest.mark.parametrize("name", ["bn_cnn", "transformer"])
def test_fp16_compression_stays_close_to_float32(jobs, name):
    for rank in range(2):
        fp32 = load(jobs(2), f"{name}-sync", rank)
        fp16 = load(jobs(2), f"{name}-fp16", rank)  # 12 steps: compared with fp32's 12 steps
        for key in ("trainable", "non_trainable"):
            difference = max_difference(fp32[f"{key}_step12"], fp16[key])
            assert difference <= FP16_TOLERANCE, f"rank {rank} {key}: {difference:.3g}"


@pytest.mark.parametrize("entry", ["bn_cnn-ssp", "bn_cnn-easgd", "transformer-ssp",
                                   "transformer-easgd"])
def test_stale_modes_learn_and_agree_after_drain(jobs, entry):
    first = load(jobs(2), entry, 0)
    # evaluation is sorted by name: accuracy, loss.
    assert first["evaluation"][-1] < first["initial_evaluation"][-1], "held-out loss did not fall"
    second = load(jobs(2), entry, 1)
    assert_close(first, second, ["trainable"], "rank 1")
    if entry.endswith("ssp"):
        # SSP's drain applies every pending update: each rank's own model is then rank 0's.
        assert_close(first, second, outputs(first, "own_"), "rank 1")


@pytest.mark.parametrize("entry", ["bn_cnn-ssp", "bn_cnn-easgd"])
def test_stale_modes_batchnorm_statistics_combined_at_drain(jobs, entry):
    # Ranks not in lockstep keep their own moving statistics while training and combine them
    # when they drain: after it every rank holds the mean of what the ranks held before.
    ranks = [load(jobs(2), entry, rank) for rank in range(2)]
    local = [r["non_trainable_local_step12"] for r in ranks]
    assert max_difference(local[0], local[1]) > TOLERANCE, "the ranks' statistics never differed"
    mean = {"mean": np.mean(local, axis=0)}
    for rank, result in enumerate(ranks):
        assert_close(mean, result, ["non_trainable_step12"], f"rank {rank}", ["mean"])
