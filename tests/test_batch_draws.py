"""batch_draws: a rank's rows of a random draw are one process's draw for the whole batch."""

import functools

import numpy as np
import pytest
import tensorflow as tf

from tf_poseidon import batch_draws

SEED = tf.constant([1234, 56], tf.int32)


def window(offset: int, rows: int, total: int, xla: bool = False) -> batch_draws.RowsWindow:
    return batch_draws.RowsWindow(*(tf.constant(v, tf.int64) for v in (offset, rows, total)),
                                  xla)


FLOATS, INTEGERS = [tf.float16, tf.bfloat16, tf.float32, tf.float64], [tf.int32, tf.int64]
DRAWS = [pytest.param(fn, reference, dtype, id=f"{name}-{dtype.name}")
         for name, fn, reference, dtypes in [
             ("uniform", batch_draws.uniform, tf.random.stateless_uniform, FLOATS),
             ("normal", batch_draws.normal, tf.random.stateless_normal, FLOATS),
             ("randint", functools.partial(batch_draws.randint, minval=-5, maxval=1000),
              functools.partial(tf.random.stateless_uniform, minval=-5, maxval=1000), INTEGERS)]
         for dtype in dtypes]


@pytest.mark.parametrize("fn, reference, dtype", DRAWS)
@pytest.mark.parametrize("xla", [False, True])
def test_the_ranks_rows_make_up_one_process_draw(fn, reference, dtype, xla):
    # One process draws for the whole batch, compiled with XLA or not (XLA's values differ
    # from the kernels'); the ranks' windows: uneven, one without rows.
    shape, splits = (11, 3, 5), [0, 3, 7, 7, 11]

    @tf.function(jit_compile=xla)
    def one_process():
        return reference(shape, SEED, dtype=dtype)

    @tf.function
    def ranks():
        return tf.concat([fn((b - a, 3, 5), SEED, dtype, window(a, b - a, 11, xla))
                          for a, b in zip(splits, splits[1:])], 0)

    np.testing.assert_array_equal(ranks().numpy(), one_process().numpy())  # bit for bit


@pytest.mark.parametrize("xla", [False, True])
def test_a_draw_whose_first_dimension_is_not_the_rows_is_drawn_as_it_is(xla):
    for shape in [(), (3,), (5, 2)]:
        expected = tf.function(lambda: tf.random.stateless_uniform(shape, SEED, 2.0, 3.0),
                               jit_compile=xla)()
        np.testing.assert_array_equal(
            batch_draws.uniform(shape, SEED, tf.float32, window(4, 4, 8, xla), 2.0, 3.0),
            expected.numpy())


def test_the_counter_carries_into_its_high_word():
    # The skipped counter's low 64 bits overflow: rows past it are still the batch's draw.
    key, counter = tf.constant([7], tf.uint64), tf.constant([2**64 - 2, 9], tf.uint64)
    draw = tf.raw_ops.StatelessRandomUniformV2
    full = draw(shape=[40], key=key, counter=counter, alg=1).numpy()
    low = counter[0] + tf.constant(3, tf.uint64)
    skipped = tf.stack([low, counter[1] + tf.cast(low < counter[0], tf.uint64)])
    np.testing.assert_array_equal(draw(shape=[28], key=key, counter=skipped, alg=1).numpy(),
                                  full[12:])


def test_assumed_windows_draw_apart():
    rows = tf.constant(4, tf.int64)
    draws = [batch_draws.uniform((4, 2), SEED, tf.float32,
                                 batch_draws.assumed_window(rows, r, 2, False))
             for r in range(2)]
    np.testing.assert_array_equal(tf.concat(draws, 0).numpy(),
                                  tf.random.stateless_uniform((8, 2), SEED).numpy())
