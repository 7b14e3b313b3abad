"""Random draws by rows of the global batch: each rank draws, of the values one process draws
for a whole global batch, the rows of its own slice.

Keras layers draw their randomness (a Dropout mask, Gaussian noise, an RNN's dropout masks, an
augmentation's per-image parameters) from seed generators whose state is the same on every rank:
rank 0's, taken with the weights, then advanced alike by every step. Drawn for the local batch
as Keras draws them, every rank would draw the same values for its rows: row i of each rank's
slice would get one and the same mask, and no row the mask one process draws for it.

TensorFlow's stateless Philox kernels compute element j of a draw from the key and the 128-bit
counter + ⌊j/k⌋, one Philox block yielding k elements (4 for 16- and 32-bit floats and int32,
2 for float64 and int64). So rows [a, a + n) of a draw of shape [B, *rest] are the draw of n·R
elements (R = prod(rest)) from counter + ⌊a·R/k⌋, less its first a·R mod k elements: a rank
draws only its own rows, bit for bit the values one process draws for them. XLA's uniform and
integer draws (other values than the kernels') have the same property, its normal draws not
(:func:`normal`); tests/test_batch_draws.py checks each (docs/synchronization.md, "Random
layers").
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import tensorflow as tf
from tensorflow.python.ops import gen_stateless_random_ops_v2, random_ops_util

_ELEMENTS_PER_BLOCK = {tf.float64: 2, tf.int64: 2}  # every other dtype: 4


@dataclasses.dataclass(frozen=True)
class RowsWindow:
    """Where this rank's rows sit in its step's global batch (int64 scalar tensors), and how
    the step draws.

    ``offset``: the rows of the ranks before this one; ``rows``: this rank's; ``total``: the
    global batch's. ``xla``: the step is compiled with XLA, as one process's then is, whose
    draws are XLA's (they differ from the kernels'), so the draws are compiled too."""

    offset: tf.Tensor
    rows: tf.Tensor
    total: tf.Tensor
    xla: bool


def agreed_window(rows: tf.Tensor, rank: int, size: int, xla: bool,
                  sum_over_ranks: Callable[[Sequence[tf.Tensor], str], list[tf.Tensor]]
                  ) -> RowsWindow:
    """This rank's window in the global batch its ``rows`` and the other ranks' make up.
    Collective (every rank, alike): one all-reduce of the ranks' row counts."""
    rows = tf.cast(rows, tf.int64)
    counts = sum_over_ranks([tf.scatter_nd([[rank]], tf.reshape(rows, [1]), [size])],
                            "draw_rows")[0]
    return RowsWindow(tf.reduce_sum(counts[:rank]), rows, tf.reduce_sum(counts), xla)


def assumed_window(rows: tf.Tensor, rank: int, size: int, xla: bool) -> RowsWindow:
    """A window without communication, as if every rank had ``rows`` rows: for ranks that do
    not step together (their batches are no one process's), so that they draw apart."""
    rows = tf.cast(rows, tf.int64)
    return RowsWindow(rank * rows, rows, size * rows, xla)


def uniform(shape, seed: tf.Tensor, dtype: tf.DType, window: RowsWindow,
            minval: float = 0.0, maxval: float = 1.0) -> tf.Tensor:
    """``tf.random.stateless_uniform(shape, seed, minval, maxval, dtype)`` (a float ``dtype``),
    drawn by rows (:func:`_by_rows`). Any thread, in or out of a graph; no communication."""
    dtype = tf.as_dtype(dtype)
    rnd = _by_rows(gen_stateless_random_ops_v2.stateless_random_uniform_v2, shape, seed, dtype,
                   window, separable_in_xla=True)
    minval, maxval = (tf.convert_to_tensor(v, dtype) for v in (minval, maxval))
    return tf.math.add(rnd * (maxval - minval), minval)  # as TensorFlow's, bit for bit


def randint(shape, seed: tf.Tensor, dtype: tf.DType, window: RowsWindow, minval: int,
            maxval: int) -> tf.Tensor:
    """``tf.random.stateless_uniform(shape, seed, minval, maxval, dtype)`` (int32 or int64
    ``dtype``), drawn by rows (:func:`_by_rows`). Any thread, in or out of a graph; no
    communication."""
    dtype = tf.as_dtype(dtype)
    minval, maxval = (tf.convert_to_tensor(v, dtype) for v in (minval, maxval))

    def draw(shape, key, counter, dtype, alg):
        return gen_stateless_random_ops_v2.stateless_random_uniform_int_v2(
            shape, key=key, counter=counter, alg=alg, minval=minval, maxval=maxval)
    return _by_rows(draw, shape, seed, dtype, window, separable_in_xla=True)


def normal(shape, seed: tf.Tensor, dtype: tf.DType, window: RowsWindow, mean: float = 0.0,
           stddev: float = 1.0) -> tf.Tensor:
    """``tf.random.stateless_normal(shape, seed, mean, stddev, dtype)``, drawn by rows
    (:func:`_by_rows`). Any thread, in or out of a graph; no communication."""
    dtype = tf.as_dtype(dtype)
    # XLA pairs a normal draw's uniforms (Box-Muller) across a dimension it picks by the
    # shape, so there a batch's rows are not a draw of their own.
    rnd = _by_rows(gen_stateless_random_ops_v2.stateless_random_normal_v2, shape, seed, dtype,
                   window, separable_in_xla=False)
    mean, stddev = (tf.convert_to_tensor(v, dtype) for v in (mean, stddev))
    return tf.math.add(rnd * stddev, mean)


def _by_rows(draw, shape, seed: tf.Tensor, dtype: tf.DType, window: RowsWindow,
             separable_in_xla: bool) -> tf.Tensor:
    """``draw`` (a V2 stateless op) of ``shape`` with ``seed`` (int32 [2]) keyed as
    ``tf.random.stateless_*`` keys it; where ``shape[0]`` is ``window.rows`` at run time (a
    batch's rows), the rows [offset, offset + rows) of the draw for the whole batch: drawn
    alone from the skipped counter or, in XLA where the draw is not ``separable_in_xla``,
    drawn for the whole batch and sliced."""
    def drawn() -> tf.Tensor:
        dims = tf.cast(tf.convert_to_tensor(shape), tf.int64)
        key, counter, alg = random_ops_util.get_key_counter_alg(seed, None)
        if dims.shape[0] == 0:  # a scalar
            return draw(dims, key=key, counter=counter, dtype=dtype, alg=alg)

        def rows_of_batch() -> tf.Tensor:
            # Sized by dims[0] (which is window.rows here), so that the branch XLA compiles
            # but does not run (another draw's shape) is well formed too.
            if window.xla and not separable_in_xla:
                whole = draw(tf.concat([[tf.maximum(window.total, dims[0])], dims[1:]], 0),
                             key=key, counter=counter, dtype=dtype, alg=alg)
                return tf.slice(whole, tf.pad([window.offset], [[0, tf.size(dims) - 1]]), dims)
            row = tf.reduce_prod(dims[1:])
            start = window.offset * row
            per_block = _ELEMENTS_PER_BLOCK.get(dtype, 4)
            lead = start % per_block
            low = counter[0] + tf.cast(start // per_block, tf.uint64)
            skipped = tf.stack([low, counter[1] + tf.cast(low < counter[0], tf.uint64)])
            flat = draw(tf.reshape(lead + dims[0] * row, [1]), key=key, counter=skipped,
                        dtype=dtype, alg=alg)
            return tf.reshape(flat[lead:], dims)

        return tf.cond(tf.equal(dims[0], window.rows), rows_of_batch,
                       lambda: draw(dims, key=key, counter=counter, dtype=dtype, alg=alg))

    return tf.function(drawn, jit_compile=True)() if window.xla else drawn()
