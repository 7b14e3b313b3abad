"""Input distribution: each rank takes its slice of every global batch.

``experimental_distribute_dataset(dataset)`` receives a dataset of *global* batches (B examples,
as TF's own strategies do). Every rank iterates the same dataset and keeps rows
``[floor(n·r/P), floor(n·(r+1)/P))`` of each batch of n rows: contiguous slices in rank order,
so concatenating the ranks' outputs gives back the input order (what ``predict`` relies on),
sizes differ by at most one (a short last batch is split too), and every rank sees the same
number of batches, so epochs end on every rank together without any extra communication.

Like TF's ``AutoShardPolicy.DATA``, every rank reads the whole input pipeline. Shuffle with a
seed, or every rank slices a different permutation of the data.
"""

from __future__ import annotations

import tensorflow as tf


def batch_size_of(structure) -> tf.Tensor | None:
    """Leading dimension of the first tensor of rank ≥ 1 in ``structure`` (None if none)."""
    for value in tf.nest.flatten(structure):
        if isinstance(value, (tf.Tensor, tf.Variable)) and value.shape.rank:
            return tf.shape(value, out_type=tf.int64)[0]
    return None


def slice_for_rank(element, rank: int, size: int):
    """Rows of ``element``'s batch that belong to ``rank`` (scalars pass through unchanged)."""
    n = batch_size_of(element)
    if n is None:
        return element
    start = n * rank // size
    end = n * (rank + 1) // size

    def take(value):
        if isinstance(value, tf.Tensor) and value.shape.rank:
            return value[start:end]
        return value

    return tf.nest.map_structure(take, element)


def distribute_global_batches(dataset: tf.data.Dataset, rank: int, size: int) -> tf.data.Dataset:
    """The dataset of this rank's slices of ``dataset``'s global batches (identity if size 1)."""
    if size == 1:
        return dataset
    spec = dataset.element_spec
    if not any(getattr(s, "shape", tf.TensorShape(None)).rank for s in tf.nest.flatten(spec)):
        raise ValueError(
            "experimental_distribute_dataset needs a batched dataset (elements with a leading "
            f"batch dimension), got elements {spec}. Call dataset.batch(GLOBAL_BATCH) first.")

    # Dataset.map unpacks tuple elements into positional arguments, and only those.
    elements_are_tuples = isinstance(spec, tuple)

    def per_rank(*element):
        return slice_for_rank(element if elements_are_tuples else element[0], rank, size)

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.map(per_rank, num_parallel_calls=tf.data.AUTOTUNE,
                       deterministic=True).with_options(options)
