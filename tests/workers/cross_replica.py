"""Worker for the cross-replica collectives of the tf.distribute API, eager and in tf.function,
and for predict on inputs and outputs whose shapes vary:

    cross_replica.py OUT

strategy.reduce (SUM, MEAN) of scalars and vectors, strategy.gather of rows that differ in
number per rank (float32 and bfloat16; also with dimensions unknown at tracing time, and a
mismatch of them that must fail on every rank), and a replica context's all_gather and its
gradient. Then
model.predict of a sequence model on batches whose time steps vary, of a model on ragged
inputs, and of a model with ragged outputs. Writes OUT/rank<r>.json (collectives) and
OUT/predict_rank<r>.npz (predictions; ragged ones as values and row lengths). Also runs as a
plain process (a world of one), which gives the predictions to compare with.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402

UNKNOWN_WIDTH = tf.TensorSpec([None, None], tf.float32)


def collectives(strategy: tp.PoseidonStrategy, gather_unknown_width) -> dict:
    r = float(tp.rank())
    rows = tf.fill([tp.rank() + 1, 2], r)  # rank r has r + 1 rows of r
    return {
        "sum_scalar": strategy.reduce("SUM", tf.constant(r + 1.0), axis=None),
        "mean_vector": strategy.reduce("MEAN", tf.constant([r, 2.0 * r, 3.0]), axis=None),
        "sum_float64": strategy.reduce("SUM", tf.constant([r], tf.float64), axis=None),
        "gather_rows": strategy.gather(rows, axis=0),
        "gather_bfloat16": tf.cast(strategy.gather(tf.cast(rows, tf.bfloat16), axis=0),
                                   tf.float32),
        "gather_unknown_width": gather_unknown_width(tf.fill([tp.rank() + 1, 3], r)),
        "all_gather": strategy.run(
            lambda: tf.distribute.get_replica_context().all_gather(tf.constant([[r]]), axis=1)),
        **{f"all_gather_gradient_axis{axis}": strategy.run(all_gather_gradient, args=(axis,))
           for axis in (0, 1)},
    }


def all_gather_gradient(axis: int) -> tf.Tensor:
    """Replica context: the gradient of this rank's r + 1 rows of 2 (along ``axis``) through
    all_gather, each rank's loss weighting the gathered rows by their place (row i: i + 1 and
    10·(i + 1)) and by the rank (r + 1). Returned as rows."""
    r = tp.rank()
    rows = tf.fill([r + 1, 2], float(r))
    part = tf.transpose(rows) if axis else rows
    with tf.GradientTape() as tape:
        tape.watch(part)
        gathered = tf.distribute.get_replica_context().all_gather(part, axis)
        all_rows = tf.transpose(gathered) if axis else gathered
        place = (tf.range(tf.shape(all_rows)[0], dtype=tf.float32) + 1)[:, None] * [1.0, 10.0]
        loss = (r + 1) * tf.reduce_sum(all_rows * place)
    gradient = tape.gradient(loss, part)
    return tf.transpose(gradient) if axis else gradient


def width_mismatch(gather_unknown_width) -> str:
    """Rank r sends rows of width r + 2; the error message every rank must raise."""
    try:
        gather_unknown_width(tf.fill([2, tp.rank() + 2], 1.0))
    except tf.errors.InvalidArgumentError as e:
        return e.message
    return "no error"


def sequence_batches():
    """Global batches of sequences whose time steps differ from batch to batch (the last
    batch is short: 5 rows)."""
    rng = np.random.default_rng(3)
    for rows, steps in [(12, 5), (12, 9), (5, 4)]:
        yield rng.normal(size=(rows, steps, 3)).astype("float32")


def ragged_batches() -> tf.data.Dataset:
    rng = np.random.default_rng(4)
    rows = [rng.normal(size=rng.integers(0, 5)).astype("float32").tolist() for _ in range(23)]
    return tf.data.Dataset.from_tensor_slices(tf.ragged.constant(rows)).ragged_batch(8)


class RaggedFeatures(keras.Model):
    """Ragged rows in, dense predictions out: sum and length of each row through a Dense.
    Built by its first call, in predict's replica function: its 2x2 kernel is initialized
    there, where at P=3 a rank's last batch has 2 rows, and must still start equal on every
    rank (drawn alike, not by rows)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        features = tf.stack([tf.reduce_sum(x, axis=1), tf.cast(x.row_lengths(), tf.float32)],
                            axis=1)
        return self.dense(features)


class RaggedScale(keras.Model):
    """Ragged rows in, ragged rows out (each value times a weight, plus a bias)."""

    def __init__(self):
        super().__init__()
        self.scale = self.add_weight(shape=(), initializer=keras.initializers.Constant(1.5))
        self.shift = self.add_weight(shape=(), initializer=keras.initializers.Constant(-0.25))

    def call(self, x):
        return x * self.scale + self.shift


def predictions(strategy: tp.PoseidonStrategy) -> dict:
    keras.utils.set_random_seed(5)
    with strategy.scope():
        inputs = keras.Input((None, 3))
        hidden = keras.layers.GRU(4, return_sequences=True)(inputs)
        sequence_model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
        ragged_in, ragged_out = RaggedFeatures(), RaggedScale()
    sequences = tf.data.Dataset.from_generator(
        sequence_batches, output_signature=tf.TensorSpec([None, None, 3], tf.float32))
    result = {}
    for name, model, data in [("sequences", sequence_model, sequences),
                              ("ragged_in", ragged_in, ragged_batches()),
                              ("ragged_out", ragged_out, ragged_batches())]:
        predicted = model.predict(data, verbose=0)
        if isinstance(predicted, tf.RaggedTensor):
            result[f"{name}_values"] = predicted.flat_values.numpy()
            for level, lengths in enumerate(predicted.nested_row_lengths()):
                result[f"{name}_lengths{level}"] = lengths.numpy()
        else:
            result[name] = predicted
    return result


def main(out: str) -> None:
    strategy = tp.PoseidonStrategy()
    report = {}
    eager_width = lambda t: strategy.gather(t, axis=0)  # noqa: E731
    traced_width = tf.function(eager_width, input_signature=[UNKNOWN_WIDTH])
    for how, fn, gather_width in [
            ("eager", lambda: collectives(strategy, eager_width), eager_width),
            ("function", tf.function(lambda: collectives(strategy, traced_width)),
             traced_width)]:
        report[how] = {k: v.numpy().tolist() for k, v in fn().items()}
        report[how]["width_mismatch"] = width_mismatch(gather_width)
    with open(os.path.join(out, f"rank{tp.rank()}.json"), "w") as f:
        json.dump(report, f)
    np.savez(os.path.join(out, f"predict_rank{tp.rank()}.npz"), **predictions(strategy))


if __name__ == "__main__":
    main(sys.argv[1])
