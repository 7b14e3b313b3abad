"""The check behind ``train_on_batch``, ``test_on_batch`` and ``predict_on_batch`` under
PoseidonStrategy (keras_integration._on_global_batch), in this process: every rank describes
its batch (data.describe_batch) and the ranks compare. The ranks are stood in for by the
descriptions a ``gather`` returns; the multi-rank form is tests/test_keras_steps.py's
``on-batch`` and ``on-batch-mismatch``."""

import numpy as np
import pytest
import tensorflow as tf

from tf_poseidon import data

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
