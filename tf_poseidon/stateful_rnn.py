"""Stateful RNNs (``keras.layers.RNN(stateful=True)`` and its LSTM, GRU, SimpleRNN) on P ranks.

A stateful RNN keeps one state per row of the batch: row i of every batch continues row i of
the batch before. Keras asks for a static batch size (``keras.Input(batch_size=B)``) and builds
the states for B rows. Each rank of a job takes the same rows of every global batch
(data.rows_of_rank), so it carries on the states of those rows only: the states, split over
the ranks in rank order, are one process's. They are this rank's own values
(``strategy.extended.rank_local_variables()``: neither checked against the other ranks nor
broadcast), and Keras does not track them as weights, so checkpoints never hold them.

What is written out of the job (``model.save``, ``export``, ``tp.export_for_serving``) is one
process's model, states included where Keras writes them (an exported model's serving function
carries its states on): :func:`whole_batch_states` gathers them for the duration of the write.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import keras
import numpy as np
import tensorflow as tf
from keras.src.layers.rnn import rnn as keras_rnn
from keras.src.utils import tracking

from tf_poseidon import data as data_lib


def _create_states(layer, batch_size: int) -> None:
    """Keras' own ``_create_state_variables``: untracked variables of zeros for ``batch_size``
    rows (keras_integration wraps the method to take this rank's rows)."""
    create = keras_rnn.RNN._create_state_variables
    getattr(create, "__tf_poseidon_original__", create)(layer, batch_size)


_split = weakref.WeakKeyDictionary()  # layer -> (global batch, rank, size)


def create_rank_states(layer, batch_size: int, extended) -> None:
    """Builds ``layer``'s states for this rank's rows of a global batch of ``batch_size`` rows
    (``extended``: the PoseidonExtended of a job of several ranks)."""
    rank, size = extended._world.rank, extended._world.size
    start, end = data_lib.rows_of_rank(batch_size, rank, size)
    with extended.rank_local_variables():
        _create_states(layer, end - start)
    _split[layer] = (batch_size, rank, size)


def check_rows(layer, sequences) -> None:
    """Raises ValueError, naming the cause and the fix, where ``layer`` holds this rank's rows
    of a global batch (:func:`create_rank_states`) and ``sequences`` has a static row count
    other than its states' (Keras' own check would say only that the two differ)."""
    rows = sequences.shape[0]
    if layer not in _split or rows is None or rows == layer._expected_batch_size:
        return
    batch, rank, size = _split[layer]
    raise ValueError(
        f"tf_poseidon: the stateful RNN {layer.name!r} was built for a batch of {batch} rows, "
        f"which is the global batch: rank {rank} of {size} holds the states of "
        f"{layer._expected_batch_size} of them, but its input here has {rows} rows. Every "
        f"global batch must have the {batch} rows the model was built for, as in one "
        "process: build the model for the global batch (keras.Input(batch_size=B)), not for "
        "a rank's share of it, and give fit, evaluate and predict batch_size=B, with no "
        "partial batch.")


@contextlib.contextmanager
def whole_batch_states(model: keras.Model, extended) -> Iterator[None]:
    """Within it, every stateful RNN of ``model`` that holds this rank's rows
    (:func:`create_rank_states`) holds the states of the whole global batch, every rank's rows
    in rank order, as one process's model would; each rank's own states come back on exit,
    unchanged. Collective and blocking (one all-gather) where ``model`` has such a layer,
    which it has on every rank or none (the ranks build the same model); call it on every rank
    of the job (``extended``), at the same point."""
    layers = [layer for layer in model._flatten_layers() if layer in _split]
    if not layers:
        yield
        return
    local = [[np.asarray(v.numpy()) for v in layer.states] for layer in layers]
    per_rank = extended.engine.call(lambda comm: comm.allgather(local),
                                    label="the stateful RNNs' states")
    own = [(layer.states, layer._expected_batch_size) for layer in layers]
    try:
        with extended.rank_local_variables(), tf.init_scope():
            for i, layer in enumerate(layers):
                whole = [np.concatenate([states[i][j] for states in per_rank])
                         for j in range(len(local[i]))]
                _create_states(layer, whole[0].shape[0])
                for variable, value in zip(layer.states, whole):
                    variable.assign(value)
                layer._expected_batch_size = whole[0].shape[0]
        yield
    finally:
        with tracking.DotNotTrackScope():  # as Keras keeps them: not the layer's weights
            for layer, (states, expected) in zip(layers, own):
                layer.states, layer._expected_batch_size = states, expected
