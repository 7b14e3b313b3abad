"""Keras' model build before ``fit`` under PoseidonStrategy, in one process: plain Keras pulls
no batch from the input before the first epoch, Keras under a strategy pulls one (and tf.data
reads ahead of it) to build the model symbolically. tf_poseidon builds from the input's
``element_spec`` instead (keras_integration._symbolic_build_from_spec), so a pipeline is read
exactly as plain Keras reads it; where tf.data does not know a dimension other than the
batch's, the model is built from a pulled batch, as Keras does. The multi-rank form, an
augmenting pipeline at P=2 against plain Keras, is tests/test_keras_steps.py's ``cnn-augmented``."""

import contextlib

import keras
import numpy as np
import tensorflow as tf

import tf_poseidon as tp

X = np.random.default_rng(0).normal(size=(64, 10)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")
BATCHES = 4


def counted_batches(pulled: list, features=10) -> tf.data.Dataset:
    """BATCHES batches of X and Y from a generator that appends each batch's index to
    ``pulled`` when tf.data pulls it; ``features=None`` declares the feature dimension
    unknown."""
    def batches():
        for i in range(BATCHES):
            pulled.append(i)
            rows = slice(16 * i, 16 * (i + 1))
            yield X[rows], Y[rows]
    return tf.data.Dataset.from_generator(batches, output_signature=(
        tf.TensorSpec((None, features), tf.float32), tf.TensorSpec((None,), tf.int32)))


def fit(strategy, dataset: tf.data.Dataset, with_input: bool = True) -> keras.callbacks.History:
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras.Sequential(([keras.Input((10,))] if with_input else [])
                                 + [keras.layers.Dense(2)])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model.fit(dataset, epochs=2, verbose=0)


def test_the_strategy_reads_the_input_as_plain_keras_does():
    plain, poseidon = [], []
    fit(None, counted_batches(plain))
    fit(tp.PoseidonStrategy(), counted_batches(poseidon))
    assert plain == list(range(BATCHES)) * 2
    assert poseidon == plain


def test_a_model_that_needs_a_shape_unknown_to_tf_data_is_built_from_a_pulled_batch():
    pulled = []
    history = fit(tp.PoseidonStrategy(), counted_batches(pulled, features=None),
                  with_input=False)
    assert len(history.history["loss"]) == 2
    assert len(pulled) > 2 * BATCHES, pulled  # the two epochs, and the build's batch
