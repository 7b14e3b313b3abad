"""The model zoo: real Keras models of the families users train, P ranks against one process.

One job per world size (tests/workers/model_zoo.py trains every entry of it): P=2 for all
models and variants, P=3 for the Transformer, the recurrent classifier and the two-input,
two-output model, and one process for the references. Every comparison is at the same global
batch over 10+ steps: weights (trainable and non-trainable), evaluate's results, predict's
outputs and the outputs of the SavedModel tp.export_for_serving wrote.

"""

import glob

import numpy as np
import pytest

from multirank import check, run_job

pytestmark = pytest.mark.multirank

TOLERANCE = 1e-5
FP16_TOLERANCE = 2e-2
ACCURACY_POINTS = 0.01

ONE = ["bn_cnn-sync", "transformer-sync", "rnn-sync", "wide_deep-sync", "wide_deep_sgd-sync",
       "mp_cnn-sync", "mp_cnn-reordered", "accum-sync", "two_io-sync"]
TWO = ["bn_cnn-sync", "bn_cnn-sbn", "bn_cnn-fp16", "bn_cnn-ssp", "bn_cnn-easgd",
       "transformer-sync", "transformer-always", "transformer-fp16", "transformer-ssp",
       "transformer-easgd", "rnn-sync", "wide_deep-sync", "wide_deep_sgd-sync", "mp_cnn-sync",
       "accum-sync", "two_io-sync"]
THREE = ["transformer-sync", "rnn-sync", "two_io-sync"]


def train(tmp_path_factory, ranks, entries):
    out = tmp_path_factory.mktemp(f"zoo_p{ranks}")
    check(run_job(ranks, "model_zoo.py", str(out), ",".join(entries), timeout=900)[0])
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


def load(out, entry, rank=0):
    errors = glob.glob(str(out / f"{entry}_rank{rank}.error"))
    if errors:
        pytest.fail(f"{entry} failed on rank {rank}:\n" + open(errors[0]).read()[-3000:])
    return np.load(out / f"{entry}_rank{rank}.npz")


def max_difference(a, b) -> float:
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b), initial=0.0))


def assert_close(reference, result, keys, tolerance, where):
    # The tolerance is relative to the compared values' scale, at least 1: float32 carries 7
    # digits, so logits of magnitude 13 (the BN CNN's) differ in their 6th digit after 87
    # steps whose weights agree to 5e-7.
    for key in keys:
        difference = max_difference(reference[key], result[key])
        scale = max(1.0, float(np.max(np.abs(np.asarray(reference[key], "float64")),
                                      initial=0.0)))
        assert difference <= tolerance * scale, \
            f"{where} {key}: max |difference| {difference:.3g} (scale {scale:.3g})"


def outputs(saved, prefix):
    return sorted(k for k in saved.files if k.startswith(prefix))


COMPARED = ["trainable", "non_trainable", "loss"]


def assert_equals_one_process(jobs, entry, ranks, reference_entry, keys, export=False):
    reference = load(jobs(1), reference_entry)
    out = jobs(ranks)
    for rank in range(ranks):
        result = load(out, entry, rank)
        assert_close(reference, result, keys, TOLERANCE, f"{entry} rank {rank}")
        if export and rank == 0:  # rank 0 wrote the export and ran it
            assert outputs(result, "export_") == outputs(reference, "export_")
            assert_close(reference, result, outputs(reference, "export_"), TOLERANCE,
                         f"{entry} export")


EXACT = [("transformer-sync", 2), ("transformer-always", 2), ("rnn-sync", 2),
         ("wide_deep-sync", 2), ("wide_deep_sgd-sync", 2), ("two_io-sync", 2),
         ("transformer-sync", 3), ("rnn-sync", 3), ("two_io-sync", 3)]


@pytest.mark.parametrize("entry,ranks", EXACT + [("accum-sync", 2), ("bn_cnn-sbn", 2)])
def test_sync_training_equals_one_process(jobs, entry, ranks):
    # Weights, the History's loss, predict and the export. sfb only changes how gradients
    # travel and sync_batchnorm makes BN exact: both are compared with one process's plain run.
    name, _ = entry.split("-")
    reference = load(jobs(1), f"{name}-sync")
    assert_equals_one_process(jobs, entry, ranks, f"{name}-sync",
                              COMPARED + outputs(reference, "predict_"), export=True)


@pytest.mark.parametrize("entry,ranks", EXACT + [("accum-sync", 2), ("bn_cnn-sbn", 2)])
def test_evaluate_equals_one_process(jobs, entry, ranks):
    name, _ = entry.split("-")
    assert_equals_one_process(jobs, entry, ranks, f"{name}-sync", ["evaluation"])


@pytest.mark.parametrize("entry", ["wide_deep-sync", "wide_deep_sgd-sync"])
def test_embeddings_travel_as_sparse_rows(jobs, entry):
    # The exactness above holds for the optimizer's sparse update only if the rows arrive as
    # IndexedSlices: the plan must have chosen sparse rows for both tables.
    plan = list(load(jobs(2), entry)["plan"])
    embeddings = [row for row in plan if "embedding" in row]
    assert len(embeddings) == 2 and all(row.endswith(" sparse") for row in embeddings), plan


def test_mixed_precision_within_what_one_process_reproduces(jobs):
    # float16 compute rounds partial sums, so one process does not reproduce itself exactly
    # when only the order of rows in each global batch changes; P ranks sum the same batch in
    # yet another order. Each difference is one sample of that rounding noise, whose size
    # varies a few times from order to order: P ranks are held to 4 times one process's,
    # key by key (a wrong loss scale or a skipped step is off by orders of magnitude more).
    reference = load(jobs(1), "mp_cnn-sync")
    reordered = load(jobs(1), "mp_cnn-reordered")
    keys = ["trainable", "loss", "evaluation"] + outputs(reference, "predict_")
    for rank in range(2):
        result = load(jobs(2), "mp_cnn-sync", rank)
        for key in keys + (outputs(reference, "export_") if rank == 0 else []):
            bound = max(TOLERANCE, 4 * max_difference(reference[key], reordered[key]))
            difference = max_difference(reference[key], result[key])
            assert difference <= bound, f"rank {rank} {key}: {difference:.3g} > {bound:.3g}"


def test_batchnorm_with_local_statistics_trains_like_one_process(jobs):
    # Without sync_batchnorm each rank normalizes with its own rows' statistics (not one
    # process's), so the result is close, not equal: accuracy on held-out digits within one
    # point, and the trained weights the same on every rank.
    reference = load(jobs(1), "bn_cnn-sync")
    accuracy = reference["evaluation"][0]  # evaluation is sorted by name: accuracy, loss
    assert accuracy > 0.9
    first = load(jobs(2), "bn_cnn-sync", 0)
    for rank in range(2):
        result = load(jobs(2), "bn_cnn-sync", rank)
        assert abs(result["evaluation"][0] - accuracy) <= ACCURACY_POINTS, rank
        assert_close(first, result, ["trainable"], 0.0, f"rank {rank}")


def test_batchnorm_statistics_identical_on_every_rank(jobs):
    first = load(jobs(2), "bn_cnn-sync", 0)
    for rank in range(1, 2):
        result = load(jobs(2), "bn_cnn-sync", rank)
        assert_close(first, result, ["non_trainable"] + outputs(first, "predict_"), 0.0,
                     f"rank {rank}")
    # The export carries the statistics every rank predicts with.
    assert max_difference(first["export_digit"], first["predict_digit"]) <= TOLERANCE


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
    for rank in range(1, 2):
        assert_close(first, load(jobs(2), entry, rank), ["trainable"], TOLERANCE,
                     f"rank {rank}")


@pytest.mark.parametrize("entry", ["bn_cnn-ssp", "bn_cnn-easgd"])
def test_stale_modes_batchnorm_statistics_agree_after_drain(jobs, entry):
    first = load(jobs(2), entry, 0)
    for rank in range(1, 2):
        assert_close(first, load(jobs(2), entry, rank), ["non_trainable"], TOLERANCE,
                     f"rank {rank}")
