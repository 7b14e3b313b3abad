"""The check behind ``train_on_batch``, ``test_on_batch`` and ``predict_on_batch`` under
PoseidonStrategy (keras_integration._on_global_batch), in this process: every rank describes
its batch (data.describe_batch) and the ranks compare. The ranks are stood in for by the
descriptions a ``gather`` returns; the multi-rank form is tests/test_keras_steps.py's
``on-batch`` and ``on-batch-mismatch``. The same for ``fit``'s arrays (data.describe_input,
data.check_same_input): their sizes and a digest of their values; the multi-rank form is
tests/test_collective_agreement.py's ``values``. And for a ``tf.data`` pipeline, the parts of its
sources it keeps (data.selections) and a digest of the numbers it starts from
(data.sources_digest); the multi-rank forms are ``shards`` and ``slices`` there. And the files a
pipeline writes its cache to (data.cache_files), one per host and rank; the multi-rank form is
``cache`` there. And the seeds a pipeline draws random numbers with (data.shuffle_seeds), of
``sample_from_datasets`` here; of shuffles in tests/test_shuffle.py. And the steps that may
reorder a pipeline's elements (data.unordered); the multi-rank form is test_shuffle.py's
``unordered``."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.trainers.data_adapters import array_data_adapter, tf_dataset_adapter
from tensorflow.python.eager import context as tf_context

from tf_poseidon import data, keras_integration

IMAGES = np.arange(5 * 4, dtype="float32").reshape(5, 4)


def batch(images=IMAGES, words=(b"a", b"b", b"c", b"d", b"e")):
    """A batch of 5 rows of every kind a Keras input may hold, and no sample weights."""
    return data.global_batch_tensors(
        [images, {"words": np.array(words), "ids": tf.ragged.constant([[1], [2, 3], [], [4], [5]]),
                  "onehot": tf.sparse.from_dense(np.eye(5, dtype="float32"))}, None])


def test_the_same_values_describe_alike_whether_arrays_or_tensors():
    assert data.describe_batch(batch()) == data.describe_batch(batch(tf.constant(IMAGES)))


@pytest.mark.parametrize("other", [
    batch(IMAGES + np.eye(5, 4, dtype="float32")),
    batch(words=(b"a", b"b", b"c", b"d", b"f")),
    batch(IMAGES[:4]),
])
def test_other_values_or_shapes_describe_differently(other):
    assert data.describe_batch(other) != data.describe_batch(batch())


def test_ranks_with_the_same_batch_pass_and_different_batches_are_refused_naming_them():
    mine = data.describe_batch(batch())
    gathered = []
    data.check_same_batch("train_on_batch", mine, lambda d: gathered.append(d) or [d, d])
    assert gathered == [mine]  # one collective when the batches agree
    shifted = data.describe_batch(batch(IMAGES + 1))
    with pytest.raises(ValueError, match=r"different batches \(of the same shapes, \(5, 4\), "
                                         r"\(5, None\), \(5, 5\), \(5,\); other values\)"):
        data.check_same_batch("train_on_batch", mine, lambda d: [d, shifted])
    with pytest.raises(ValueError, match=r"batches of different shapes \(rank 0: \(5, 4\).*; "
                                         r"rank 1: \(4, 4\)"):
        data.check_same_batch("test_on_batch", mine,
                              lambda d: [d, data.describe_batch(batch(IMAGES[:4]))])


def fit_input(x, y, **kwargs) -> dict:
    """data.describe_input of the adapter Keras makes for ``fit(x, y, **kwargs)``."""
    adapter = array_data_adapter.ArrayDataAdapter(x, y, batch_size=16, shuffle=True, **kwargs)
    return data.describe_input(adapter)


def test_fit_arrays_describe_alike_only_with_the_same_values_in_the_same_order():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(1000, 3, 2)).astype("float32"), rng.integers(0, 2, size=1000)
    words = tf.constant([f"w{i}" for i in range(1000)])
    mine = fit_input({"x": x, "words": words}, y)
    assert mine == fit_input({"x": x.copy(), "words": tf.identity(words)}, y.copy())
    assert mine == fit_input({"x": tf.constant(x), "words": words}, tf.constant(y))
    order = rng.permutation(1000)
    for other in [{"x": x[order], "words": tf.gather(words, order)}, {"x": x + 1, "words": words},
                  {"x": x, "words": tf.roll(words, 1, 0)}]:
        theirs = fit_input(other, y)
        assert theirs != mine
        assert {k: v for k, v in theirs.items() if k != "values"} == {
            k: v for k, v in mine.items() if k != "values"}
    assert fit_input({"x": x, "words": words}, y, sample_weight=np.ones(1000)) != mine
    assert fit_input(x[:0], y[:0])["values"] == fit_input(x[:0] + 1, y[:0])["values"]


def test_sparse_and_ragged_arrays_describe_alike_only_in_the_same_order():
    dense = np.eye(12, dtype="float32")
    ragged = [[float(i)] * (1 + i % 3) for i in range(12)]
    order = np.roll(np.arange(12), 5)
    for same, other in [(tf.sparse.from_dense(dense), tf.sparse.from_dense(dense[order])),
                        (tf.ragged.constant(ragged), tf.ragged.constant([ragged[i]
                                                                         for i in order]))]:
        assert fit_input(same, np.arange(12)) == fit_input(same, np.arange(12))
        assert fit_input(same, np.arange(12)) != fit_input(other, np.arange(12))


def test_arrays_that_differ_only_in_values_are_refused_saying_so():
    mine = fit_input(IMAGES, np.arange(5))
    other = fit_input(IMAGES[::-1], np.arange(5))
    with pytest.raises(ValueError, match=r"the ranks were given different data \(rank 0: 1 "
                       r"batch of 16, the last of 5; rank 1: 1 batch of 16, the last of 5; "
                       r"the same sizes, other values: arrays split or permuted at random on "
                       r"each rank, unseeded \(e\.g\. sklearn's train_test_split without "
                       r"random_state\), or each rank's own data\)"):
        data.check_same_input(mine, lambda d: [d, other])


def pipeline_input(dataset: tf.data.Dataset) -> dict:
    """data.describe_input of the adapter Keras makes for ``fit(dataset)``."""
    return data.describe_input(tf_dataset_adapter.TFDatasetAdapter(dataset))


def test_pipelines_keeping_other_parts_of_their_sources_describe_differently():
    files = tf.data.Dataset.from_tensor_slices([f"part-{i}" for i in range(8)])
    def sharded(rank):  # a Horovod script's pipeline: its own files, then its own records
        return files.shard(2, rank).interleave(
            lambda name: tf.data.Dataset.from_tensors(name).repeat(4)).skip(rank).batch(4)
    assert data.selections(sharded(1)) == ["skip(1)", "shard(2, 1)"]
    assert pipeline_input(sharded(0)) == pipeline_input(sharded(0))
    assert pipeline_input(sharded(0)) != pipeline_input(sharded(1))
    assert data.describe_dataset(sharded(0)) == data.describe_dataset(sharded(0))
    assert data.describe_dataset(sharded(0)) != data.describe_dataset(sharded(1))
    assert data.selections(files.batch(4)) == []
    found = []

    @tf.function
    def build(index):  # a pipeline built in a tf.function: its values are not known
        found.extend(data.selections(files.shard(2, index)))
        return 0
    build(tf.constant(1, tf.int64))
    assert found == ["shard(?)"]


def test_a_pipeline_sharded_by_rank_is_refused_naming_each_ranks_part_and_the_fix():
    dataset = tf.data.Dataset.range(64)
    mine, theirs = (pipeline_input(dataset.shard(2, r).batch(8)) for r in (0, 1))
    with pytest.raises(ValueError, match=r"given different data \(rank 0: 4 batches, keeping "
                       r"shard\(2, 0\); rank 1: 4 batches, keeping shard\(2, 1\)\)\..*"
                       r"Dataset\.shard\(num_workers, rank\) as in a Horovod script: "
                       r"tf_poseidon splits every global batch between the ranks itself"):
        data.check_same_input(mine, lambda d: [d, theirs])
    skipped = pipeline_input(dataset.skip(32).batch(8))
    with pytest.raises(ValueError, match=r"rank 0: 4 batches, keeping every element; rank 1: "
                       r"4 batches, keeping skip\(32\)\)"):
        data.check_same_input(pipeline_input(dataset.take(32).batch(8)),
                              lambda d: [d, skipped])


def test_pipelines_from_other_numbers_describe_differently_whatever_their_file_names():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 3)).astype("float32"), rng.integers(0, 2, size=64)
    def sliced(*tensors):
        return pipeline_input(tf.data.Dataset.from_tensor_slices(tensors).batch(8))
    mine = sliced(x, y)
    assert mine == sliced(x.copy(), tf.constant(y))
    order = rng.permutation(64)
    for other in [sliced(x[order], y[order]), sliced(x + 1, y), sliced(x, 1 - y)]:
        assert other != mine
        assert {k: v for k, v in other.items() if k != "values"} == {
            k: v for k, v in mine.items() if k != "values"}
    whole = tf.data.Dataset.from_tensors((x, y)).repeat(8)
    assert data.sources_digest(whole) == data.sources_digest(
        tf.data.Dataset.from_tensors((x.copy(), y)).repeat(8))
    assert data.sources_digest(whole) != data.sources_digest(
        tf.data.Dataset.from_tensors((x, 1 - y)).repeat(8))
    with pytest.raises(ValueError, match=r"the same sizes, other values: arrays split or "
                                         r"permuted at random on each rank"):
        data.check_same_input(mine, lambda d: [d, sliced(x[::-1], y[::-1])])
    # Each host may keep the same files under another path.
    assert (data.sources_digest(tf.data.Dataset.from_tensor_slices(["/a/1.png", "/a/2.png"]))
            == data.sources_digest(tf.data.Dataset.from_tensor_slices(["/b/1.png", "/b/2.png"])))


def test_ranks_of_one_host_writing_one_cache_file_are_refused_and_own_files_pass(tmp_path):
    rows = tf.data.Dataset.range(64)
    shared = str(tmp_path / "train_cache")
    def cached(name):
        return rows.cache(name).shuffle(8, seed=1).batch(8)
    assert data.cache_files(cached(shared)) == [shared]
    assert data.cache_files(cached("")) == []  # in memory
    relative = tmp_path.name + "/train_cache"
    assert data.cache_files(rows.cache(relative)) == [os.path.abspath(relative)]
    one_host = lambda located: [located, located]  # noqa: E731  (a rank beside this one)
    with pytest.raises(ValueError, match=r"ranks 0, 1 on host \S+ would each write the cache "
                       r"file of Dataset\.cache\('.*train_cache'\) at once: .*"
                       r"AlreadyExistsError.*dataset\.cache\(f\"\{path\}-\{tp\.rank\(\)\}\"\)"):
        data.check_cache_files(data.cache_files(cached(shared)), one_host)
    data.check_cache_files(data.cache_files(cached(shared)),
                           lambda located: [located, ("elsewhere", located[1])])
    # A file per rank (the fix) passes, and is the same data: the names are not compared.
    data.check_cache_files([shared], lambda located: [located, (located[0], [shared + "-1"])])
    data.check_same_input(pipeline_input(cached(shared)),
                          lambda d: [d, pipeline_input(cached(shared + "-1"))])
    # A complete cache is only read: every rank may read one file.
    list(cached(shared))
    assert data.cache_files(cached(shared)) == []
    data.check_cache_files(data.cache_files(cached(shared)), one_host)


def test_sampling_from_datasets_without_a_seed_is_refused_like_an_unseeded_shuffle():
    previous = tf_context.global_seed()
    tf.random.set_seed(None)  # as a script that seeds nothing
    try:
        parts = [tf.data.Dataset.range(0, 64, 2), tf.data.Dataset.range(1, 64, 2)]
        def sampled(seed=None):
            return tf.data.Dataset.sample_from_datasets(parts, [0.5, 0.5], seed=seed).batch(8)
        assert data.shuffle_seeds(sampled()) == [None]
        with pytest.raises(ValueError, match=r"the input pipeline shuffles without a seed "
                           r"\(Dataset\.shuffle, or Dataset\.sample_from_datasets or "
                           r"Dataset\.random, with no seed"):
            data.check_same_input(pipeline_input(sampled()), lambda d: [d, d])
        assert data.shuffle_seeds(sampled(3)) == data.shuffle_seeds(sampled(3)) != [None]
        with pytest.raises(ValueError, match=r"shuffled with seeds \[\(\d+, 3\)\]; rank 1: a "
                           r"dataset of unknown length, shuffled with seeds \[\(\d+, 4\)\]"):
            data.check_same_input(pipeline_input(sampled(3)),
                                  lambda d: [d, pipeline_input(sampled(4))])
    finally:
        tf.random.set_seed(previous)


def test_steps_that_may_reorder_the_elements_are_named_and_refused():
    rows = tf.data.Dataset.range(64)
    parts = lambda i: tf.data.Dataset.range(i * 8, i * 8 + 8)  # noqa: E731
    ordered = rows.map(lambda i: i + 1, num_parallel_calls=2).interleave(
        parts, num_parallel_calls=2).batch(8, num_parallel_calls=2)
    assert data.unordered(ordered) == []
    assert data.unordered(rows.map(lambda i: i, num_parallel_calls=2, deterministic=False)
                          .interleave(parts, num_parallel_calls=2, deterministic=False)
                          .batch(8, num_parallel_calls=2, deterministic=False)) == [
        "Dataset.batch", "Dataset.interleave", "Dataset.map"]
    options = tf.data.Options()
    options.deterministic = False
    assert data.unordered(ordered.with_options(options)) == [
        "Dataset.batch", "Dataset.interleave", "Dataset.map"]
    legacy = tf.data.experimental.parallel_interleave  # as older Horovod examples read files
    assert data.unordered(rows.apply(legacy(parts, cycle_length=2, sloppy=True))) == [
        "tf.data.experimental.parallel_interleave"]
    assert data.unordered(rows.apply(legacy(parts, cycle_length=2))) == []
    # A step's own deterministic=True holds whatever the options say.
    assert data.unordered(rows.map(lambda i: i, num_parallel_calls=2, deterministic=True)
                          .with_options(options)) == []
    with pytest.raises(ValueError, match=r"no fixed order \(Dataset\.batch, Dataset\.interleave, "
                       r"Dataset\.map: deterministic=False, sloppy=True or tf\.data\.Options"):
        data.check_same_input(pipeline_input(ordered.with_options(options)), lambda d: [d, d])


def test_a_rank_without_rows_adds_nothing_to_the_models_means():
    # keras_integration._means_of_rows_only, entered by the steps fit and evaluate run: a loss
    # that is a mean over no rows (a layer's add_loss, a custom step's own) is NaN, which a
    # Mean records as NaN even at weight 0. The multi-rank form: test_sync_exactness's no_rows.
    class Tracking(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)
            self.kl = keras.metrics.Mean(name="kl")

        def call(self, x):
            return self.dense(x)

    model = Tracking()
    model.compile(loss="mse", metrics=["mae"])
    loss, kl = model._loss_tracker, model.kl
    assert {loss, kl} <= set(model.metrics)
    with keras_integration._means_of_rows_only(model, tf.constant(0, tf.int64)):
        loss.update_state(float("nan"), sample_weight=0)
        kl.update_state(float("nan"))
    assert [float(m.count) for m in (loss, kl)] == [0.0, 0.0]
    assert [float(m.result()) for m in (loss, kl)] == [0.0, 0.0]
    with keras_integration._means_of_rows_only(model, tf.constant(3, tf.int64)):
        loss.update_state(2.0, sample_weight=3)
        kl.update_state(5.0)
    assert [float(m.result()) for m in (loss, kl)] == [2.0, 5.0]
    # Nested in it, as a multi-output model's per-output loss metrics are (CompileLoss.call).
    with keras_integration._means_of_rows_only(model, tf.constant(0, tf.int64)):
        with keras_integration._weighted_updates([kl, kl], tf.constant(2.0)):
            kl.update_state(float("nan"))
    assert float(kl.result()) == 5.0 and "update_state" not in vars(kl)
    loss.update_state(float("nan"), sample_weight=0)  # what Keras' own update records
    assert np.isnan(float(loss.result()))

