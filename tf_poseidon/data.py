"""Input distribution: each rank takes its slice of every global batch.

Two entry points, matching the strategy's two dataset methods:

``experimental_distribute_dataset(dataset)`` receives a dataset of *global* batches (B examples,
as TF's own strategies do). Every rank iterates the same dataset and keeps rows
``[floor(n·r/P), floor(n·(r+1)/P))`` of each batch of n rows: contiguous slices in rank order,
so concatenating the ranks' outputs gives back the input order (what ``predict`` relies on),
sizes differ by at most one (a short last batch is split too), and every rank sees the same
number of batches, so epochs end on every rank together without any extra communication.

Like TF's ``AutoShardPolicy.DATA``, every rank reads the whole input pipeline, so every rank
must be given the same one: :func:`check_same_input` refuses a pipeline whose shuffles have no
seed or seeds that differ between the ranks, one that keeps another part of its sources on each
rank (``Dataset.shard(P, rank)``, as a Horovod script shards its data: every rank would take its
slice of a batch of its own shard), and one that starts from other numbers. Beside it
:func:`check_cache_files` refuses ranks of one host that would write one ``Dataset.cache`` file
(TensorFlow refuses a second writer). Keras' own shuffling is given seeds every rank agrees on:
of arrays' samples (``fit(x, y, shuffle=True)``) through :func:`agreed_permutation_seeds` and
:func:`tracing_seed`, of a ``keras.utils.PyDataset``'s batches (``fit(py_dataset)``, shuffled by
default) through :class:`AgreedBatchOrder`; both shuffle as one process would with rank 0's
seed.

Both checks run where ``fit``, ``evaluate`` and ``predict`` start (with what Keras' data adapter
knows of their input, keras_integration.py) and in ``experimental_distribute_dataset`` (custom
loops; strategy.py: ``check_input``); :func:`check_cache_files` alone in
``distribute_datasets_from_function``, whose datasets are each rank's own.

``distribute_datasets_from_function(fn)`` gives each rank a dataset of its own, whose length
may differ between ranks. :func:`end_together` cuts every rank's dataset to the shortest one's
length, agreed once when the dataset is distributed, so every epoch ends on every rank together.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import itertools
import os
import random
import secrets
import socket
import sys
from typing import Callable, Iterator

import keras
import numpy as np
import tensorflow as tf
from keras.src import tree
from keras.src.trainers.data_adapters import array_data_adapter, array_slicing
from tensorflow.python.data.ops import batch_op, cache_op, from_tensor_slices_op
from tensorflow.python.data.ops import from_tensors_op, interleave_op, map_op, random_op
from tensorflow.python.data.ops import readers, shard_op, shuffle_op, skip_op
from tensorflow.python.distribute import input_lib
from tensorflow.python.eager import context

from tf_poseidon import world
from tf_poseidon.comm.agreement import rank_list


def batch_size_of(structure) -> tf.Tensor | None:
    """Leading dimension (int64) of the first tensor of rank ≥ 1 in ``structure``: dense,
    ``tf.RaggedTensor`` (its rows) or ``tf.SparseTensor``; None if there is none."""
    for value in tf.nest.flatten(structure):
        if isinstance(value, (tf.Tensor, tf.Variable)) and value.shape.rank:
            return tf.shape(value, out_type=tf.int64)[0]
        if isinstance(value, tf.RaggedTensor):
            return tf.cast(value.nrows(), tf.int64)
        if isinstance(value, tf.SparseTensor):
            return value.dense_shape[0]
    return None


def rows_of_rank(n, rank: int, size: int):
    """``(start, end)``: the rows ``[n·rank/P, n·(rank+1)/P)`` of a batch of ``n`` rows (an
    int or an integer tensor) that belong to ``rank`` of ``size``."""
    return n * rank // size, n * (rank + 1) // size


def slice_for_rank(element, rank: int, size: int):
    """Rows of ``element``'s batch that belong to ``rank`` (:func:`rows_of_rank`) of every
    dense, ragged or sparse tensor of rank ≥ 1 (scalars pass through unchanged)."""
    n = batch_size_of(element)
    if n is None:
        return element
    start, end = rows_of_rank(n, rank, size)

    def take(value):
        if isinstance(value, tf.SparseTensor):
            zeros = tf.zeros_like(value.dense_shape[1:])
            return tf.sparse.slice(value, tf.concat([[start], zeros], 0),
                                   tf.concat([[end - start], value.dense_shape[1:]], 0))
        if isinstance(value, (tf.Tensor, tf.RaggedTensor)) and value.shape.rank:
            return value[start:end]
        return value

    return tf.nest.map_structure(take, element)


class RankLocalDataset(input_lib.DistributedDatasetsFromFunction):
    """What the strategy's dataset methods return: this rank's part of the input.

    A ``tf.distribute.DistributedDataset`` so that Keras (and users) know it is distributed
    already and do not distribute it again; iterating it yields this rank's batches as plain
    tensors (one local replica), from an ordinary ``tf.data`` iterator. It derives from TF's
    ``DistributedDatasetsFromFunction`` (without using its machinery) because Keras recognises
    distributed datasets by that class name; every method Keras and users call is defined here.
    """

    def __init__(self, dataset: tf.data.Dataset):  # pylint: disable=super-init-not-called
        self._dataset = dataset

    @property
    def dataset(self) -> tf.data.Dataset:
        """The underlying rank-local ``tf.data.Dataset``."""
        return self._dataset

    def __iter__(self):
        return iter(self._dataset)

    @property
    def element_spec(self):
        return self._dataset.element_spec

    def reduce(self, initial_state, reduce_func):
        return self._dataset.reduce(initial_state, reduce_func)

    def cardinality(self) -> tf.Tensor:
        return self._dataset.cardinality()


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

    # No auto_shard_policy: the slicing above is the sharding. (Setting it, which only
    # TensorFlow's own strategies read, would make TensorFlow warn on every rank each time
    # Keras' array adapter, which sets it to DATA, feeds fit, evaluate or predict.)
    return dataset.map(per_rank)


def end_together(dataset: tf.data.Dataset,
                 min_over_ranks: Callable[[int], int]) -> tf.data.Dataset:
    """``dataset``, cut to the length of the shortest rank's copy.

    ``min_over_ranks(n) -> min over ranks of n`` is a collective, called once, eagerly. A
    dataset's length is its cardinality when TensorFlow knows it, else it is counted with one
    pass over the data now. Infinite datasets are left as they are (their steps are given to
    ``fit`` by ``steps_per_epoch``). The elements a longer copy has past that length are
    dropped, every epoch.

    Agreeing once, up front, rather than element by element keeps every collective out of
    tf.data's threads, which run ahead and are abandoned with their iterators.
    """
    length = int(dataset.cardinality())
    if length == tf.data.UNKNOWN_CARDINALITY:
        length = int(dataset.reduce(np.int64(0), lambda count, _: count + 1))
    finite = length != tf.data.INFINITE_CARDINALITY
    shortest = min_over_ranks(length if finite else np.iinfo(np.int64).max)
    if shortest == np.iinfo(np.int64).max:
        return dataset
    return dataset.take(shortest)


def _pipeline(dataset: tf.data.Dataset) -> Iterator[tf.data.Dataset]:
    """``dataset`` and every dataset it reads, from the output back to the sources, through
    their Python-side inputs: a dataset built inside a function (``interleave``, ``flat_map``)
    is not seen."""
    pending, seen = [dataset], set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        try:
            pending.extend(node._inputs())  # pylint: disable=protected-access
        except (AttributeError, NotImplementedError, TypeError):
            pass


def _known_ints(*values) -> tuple[int, ...] | None:
    """The values (Python numbers, None as 0, or eager tensors) as ints; None where one is a
    symbolic tensor (a pipeline built in a tf.function), not known here."""
    try:
        return tuple(int(v or 0) for v in values)
    except TypeError:
        return None


def shuffle_seeds(dataset: tf.data.Dataset) -> list[tuple[int, int] | None]:
    """The (seed, seed2) of every ``Dataset.shuffle`` and ``Dataset.random`` (which
    ``Dataset.sample_from_datasets`` draws its choices from) in ``dataset``'s pipeline
    (:func:`_pipeline`); None for one with neither its own seed nor a global one, whose order
    TensorFlow draws afresh in every process; (-1, -1) for a seed held in a symbolic tensor,
    which is not checked."""
    found = []
    for node in _pipeline(dataset):
        # pylint: disable=protected-access
        if isinstance(node, (shuffle_op._ShuffleDataset, random_op._RandomDataset)):
            seeds = _known_ints(node._seed, node._seed2) or (-1, -1)
            found.append(seeds if any(seeds) else None)
    return found


def _keeping_deterministic(dataset_class: type) -> None:
    """Makes ``dataset_class`` (TensorFlow's parallel interleave, which passes its
    ``deterministic`` argument to its graph op only) keep it as ``_deterministic``, in the form
    TensorFlow's parallel map and batch keep theirs: "default", "true" or "false"."""
    init = dataset_class.__init__
    signature = inspect.signature(init)

    @functools.wraps(init)
    def keeping(self, *args, **kwargs):
        given = signature.bind(self, *args, **kwargs).arguments.get("deterministic")
        self._deterministic = "default" if given is None else "true" if given else "false"
        init(self, *args, **kwargs)
    dataset_class.__init__ = keeping


_keeping_deterministic(interleave_op._ParallelInterleaveDataset)  # pylint: disable=protected-access


def unordered(dataset: tf.data.Dataset) -> list[str]:
    """The steps of ``dataset``'s pipeline (:func:`_pipeline`) that may yield their elements
    in another order in every process: each parallel ``map``, ``interleave`` and ``batch``
    given ``deterministic=False`` (``tf.data.experimental.parallel_interleave``:
    ``sloppy=True``), or left to the default where the pipeline's
    ``tf.data.Options.deterministic`` is False; as the names of the calls
    ("Dataset.interleave"). An interleave built before tf_poseidon was imported is not seen."""
    # pylint: disable=protected-access
    steps = {map_op._ParallelMapDataset: "Dataset.map",
             interleave_op._ParallelInterleaveDataset: "Dataset.interleave",
             batch_op._ParallelBatchDataset: "Dataset.batch",
             readers.ParallelInterleaveDataset: "tf.data.experimental.parallel_interleave"}
    unordered_settings = {"false", "default"} if dataset.options().deterministic is False \
        else {"false"}
    return [steps[type(node)] for node in _pipeline(dataset) if type(node) in steps
            and getattr(node, "_deterministic", None) in unordered_settings]


def selections(dataset: tf.data.Dataset) -> list[str]:
    """Where ``dataset``'s pipeline (:func:`_pipeline`) keeps part of its source's elements by
    position: each ``Dataset.shard(num_shards, index)`` and ``skip(count)``, as the text of the
    call ("shard(2, 1)", "skip(32)"; "?" for a symbolic value). Ranks given the same global
    pipeline have the same; a pipeline sharded by rank, as a Horovod script shards its data,
    does not."""
    found = []
    for node in _pipeline(dataset):
        # pylint: disable=protected-access
        if isinstance(node, shard_op._ShardDataset):
            call, values = "shard", (node._num_shards, node._index)
        elif isinstance(node, skip_op._SkipDataset):
            call, values = "skip", (node._count,)
        else:
            continue
        known = _known_ints(*values)
        found.append(f"{call}({', '.join(map(str, known)) if known else '?'})")
    return found


def sources_digest(dataset: tf.data.Dataset) -> str:
    """A digest of the numbers ``dataset``'s pipeline (:func:`_pipeline`) starts from: the
    tensors of its ``from_tensor_slices`` and ``from_tensors``, each by :func:`arrays_digest`
    along its first dimension. Strings are left out (file names may differ between hosts that
    hold the same files), and so are tensors of a pipeline built in a tf.function."""
    digest = hashlib.blake2b(digest_size=8)
    for node in _pipeline(dataset):
        # pylint: disable=protected-access
        if isinstance(node, (from_tensor_slices_op._TensorSliceDataset,
                             from_tensors_op._TensorDataset)):
            for tensor in node._tensors:
                if tf.is_symbolic_tensor(tensor) or not (
                        tensor.dtype.is_floating or tensor.dtype.is_integer
                        or tensor.dtype.is_bool):
                    continue
                rows = tf.reshape(tensor, [1, -1]) if tensor.shape.rank == 0 else tensor
                digest.update(arrays_digest(rows, int(rows.shape[0])).encode())
    return digest.hexdigest()


def cache_files(dataset: tf.data.Dataset) -> list[str]:
    """The files ``dataset``'s pipeline (:func:`_pipeline`) will write its cache to: each
    ``Dataset.cache(filename)`` whose cache is not complete yet (no ``<filename>.index``), a
    local path made absolute. Left out: in-memory caches, complete caches (iterators only read
    them) and names held in a symbolic tensor."""
    found = []
    for node in _pipeline(dataset):
        # pylint: disable=protected-access
        if not isinstance(node, cache_op.CacheDataset) or tf.is_symbolic_tensor(node._filename):
            continue
        name = node._filename.numpy().decode()
        if name and not tf.io.gfile.exists(name + ".index"):
            found.append(name if "://" in name else os.path.abspath(name))
    return found


def shared_cache_files(located: list[tuple[str, list[str]]]) -> str | None:
    """The message refusing input where ranks on one host would write one cache file, else
    None. ``located``: per rank, its host name and its :func:`cache_files`.

    TensorFlow lets one iterator at a time write a cache file (it holds a lock file beside
    it): every other rank's fails with AlreadyExistsError when it starts, and the lock of a
    killed job stays behind. Ranks on other hosts write to their own disks, unless the hosts
    share the file system, which is not detected here."""
    writers: dict[tuple[str, str], list[int]] = {}
    for rank, (host, files) in enumerate(located):
        for name in dict.fromkeys(files):
            writers.setdefault((host, name), []).append(rank)
    shared = [(host, name, ranks) for (host, name), ranks in writers.items() if len(ranks) > 1]
    if not shared:
        return None
    host, name, ranks = shared[0]
    return (f"{rank_list(ranks)} on host {host} would each write the cache file of "
            f"Dataset.cache({name!r}) at once: TensorFlow lets one process at a time write a "
            "cache file, so the others would fail with AlreadyExistsError (\"a concurrent "
            "caching iterator\"). Give each rank a file of its own, e.g. "
            "dataset.cache(f\"{path}-{tp.rank()}\") (also where hosts share the file system), "
            "or cache in memory with dataset.cache().")


def check_cache_files(files: list[str], gather: Callable[[object], list]) -> None:
    """Raises ValueError on every rank where ranks on one host would write one cache file
    (:func:`shared_cache_files`). ``files``: this rank's :func:`cache_files` of its input, which
    may differ between the ranks. ``gather(x) -> every rank's x`` is a collective, called once
    (twice when refusing)."""
    located = (socket.gethostname(), files)
    shared = shared_cache_files(gather(located))
    if shared:
        _refuse_on_every_rank(shared, lambda: gather(located))


def describe_dataset(dataset: tf.data.Dataset) -> dict:
    """What a ``tf.data`` pipeline of global batches says about itself, the same on every rank
    that was given the same pipeline: its number of batches (None where unknown or infinite),
    its shuffles' seeds (:func:`shuffle_seeds`), the parts of its sources it keeps
    (:func:`selections`) and a digest of the numbers it starts from (:func:`sources_digest`);
    in the form of :func:`describe_input`, batch sizes unknown."""
    length = int(dataset.cardinality())
    return {"batches": length if length >= 0 else None, "batch_size": None, "last_batch": None,
            "shuffles": shuffle_seeds(dataset), "selections": selections(dataset),
            "values": sources_digest(dataset), "unordered": unordered(dataset)}


def describe_input(adapter) -> dict:
    """What a Keras data adapter says about its input (the same on every rank that was given the
    same global data): batches per epoch, batch size, the last batch's size (None where the
    adapter does not know, as for a ``tf.data`` pipeline of unknown length), for a ``tf.data``
    pipeline what :func:`describe_dataset` says, and for arrays a digest of their values
    (:func:`arrays_digest`)."""
    def known(name):
        try:
            return getattr(adapter, name)
        except (NotImplementedError, AttributeError, TypeError, ValueError):
            return None
    # A distributed dataset (RankLocalDataset) may be rank-local by design
    # (distribute_datasets_from_function): only a global pipeline's must agree.
    dataset = getattr(adapter, "_dataset", None)
    described = (describe_dataset(dataset) if isinstance(dataset, tf.data.Dataset)
                 else {"shuffles": [], "selections": [], "values": None, "unordered": []})
    if isinstance(adapter, array_data_adapter.ArrayDataAdapter):
        described["values"] = arrays_digest(adapter._inputs, adapter._num_samples)
    return described | {"batches": known("num_batches"), "batch_size": known("batch_size"),
                        "last_batch": known("partial_batch_size") or None}


def arrays_digest(arrays, rows: int) -> str:
    """A digest of the values of ``arrays`` (a nested structure of array-likes of ``rows``
    rows, as ``fit(x, y, sample_weight)`` takes them): of at most 64 evenly spaced rows, each
    leaf's at most 64 evenly spaced values per row. Cheap whatever the arrays' size, and
    different, but for a chance of 2**-64, for arrays in another order (a split or
    permutation drawn differently on each rank) or with other values at those places."""
    picked_rows = np.unique(np.linspace(0, max(rows - 1, 0), min(rows, 64), dtype=np.int64))
    digest = hashlib.blake2b(digest_size=8)
    if not len(picked_rows):
        return digest.hexdigest()
    for array in tree.flatten(arrays):
        try:
            sliceable = array_slicing.convert_to_sliceable(array, target_backend="numpy")
        except (TypeError, ValueError):  # what Keras cannot slice, its fit refuses itself
            digest.update(type(array).__name__.encode())
            continue
        picked = np.asarray(sliceable.convert_to_numpy(sliceable[picked_rows]))
        picked = picked.reshape(len(picked_rows), -1)
        columns = np.unique(np.linspace(0, max(picked.shape[1] - 1, 0),
                                        min(picked.shape[1], 64), dtype=np.int64))
        digest.update(repr(picked[:, columns].tolist()).encode())
    return digest.hexdigest()


def check_same_input(description: dict, gather: Callable[[dict], list]) -> None:
    """Raises ValueError on every rank if the ranks were given different inputs, or an input
    that shuffles without a seed.

    ``gather(description) -> every rank's description`` is a collective (called once, now; once
    more when the inputs differ: every rank prints the error before any raises it, so that each
    rank's output has it before the first to raise aborts the job). ``fit``, ``evaluate``,
    ``predict`` and ``experimental_distribute_dataset`` take the *global* data on every rank
    and split each batch themselves; data of different lengths would make the ranks run
    different numbers of steps (or batches of different sizes) and fail later, far from the
    cause, and data in different orders would silently train each step on slices of different
    global batches. An unseeded shuffle, and a pipeline whose order is not deterministic
    (:func:`unordered`), are refused before the collective, alike on every rank (every rank
    builds the same pipeline).
    """
    if None in description["shuffles"]:
        raise ValueError(
            "tf_poseidon: the input pipeline shuffles without a seed (Dataset.shuffle, or "
            "Dataset.sample_from_datasets or Dataset.random, with no seed, and no global seed "
            "set): every rank would draw its own order and take its "
            "slice of a different global batch at every step. Pass a seed "
            "(dataset.shuffle(n, seed=...)), or call keras.utils.set_random_seed(...) with the "
            "same seed on every rank before building the pipeline.")
    if description.get("unordered"):
        raise ValueError(
            "tf_poseidon: the input pipeline yields its elements in no fixed order "
            f"({', '.join(description['unordered'])}: deterministic=False, sloppy=True or "
            "tf.data.Options.deterministic = False): every rank would read them in an order of "
            "its own and take its slice of a different global batch at every step. Leave "
            "deterministic to its default (True), and sloppy to False, in this pipeline.")
    everyone = gather(description)
    if all(d == everyone[0] for d in everyone):
        return
    shuffles_differ = any(d["shuffles"] != everyone[0]["shuffles"] for d in everyone)
    selections_differ = any(d["selections"] != everyone[0]["selections"] for d in everyone)
    sizes = [{key: value for key, value in d.items() if key != "values"} for d in everyone]
    only_values_differ = all(s == sizes[0] for s in sizes)

    def said(rank, d):
        if d["batches"] is None:
            text = f"rank {rank}: a dataset of unknown length"
        else:
            text = f"rank {rank}: {d['batches']} batch{'es' if d['batches'] != 1 else ''}"
            if d["batch_size"] is not None:
                text += f" of {d['batch_size']}"
                if d["last_batch"]:
                    text += f", the last of {d['last_batch']}"
        if shuffles_differ:
            text += f", shuffled with seeds {d['shuffles']}"
        if selections_differ:
            text += f", keeping {' then '.join(reversed(d['selections'])) or 'every element'}"
        return text
    sides = "; ".join(said(r, d) for r, d in enumerate(everyone))
    if only_values_differ:
        sides += ("; the same sizes, other values: arrays split or permuted at random on each "
                  "rank, unseeded (e.g. sklearn's train_test_split without random_state), or "
                  "each rank's own data")
    seeds = (" (here the seeds differ: pass the same seed to every shuffle, or call "
             "keras.utils.set_random_seed(...) with the same seed on every rank before building "
             "the pipeline; keras.utils.image_dataset_from_directory and the text and audio "
             "ones given no seed draw theirs from numpy's global generator)"
             if shuffles_differ else "")
    parts = (" (here each rank keeps another part of the data, e.g. Dataset.shard(num_workers, "
             "rank) as in a Horovod script: tf_poseidon splits every global batch between the "
             "ranks itself, so build the same pipeline on every rank without it, batched by the "
             "global batch size: the batch per rank times the number of ranks)"
             if selections_differ else "")
    _refuse_on_every_rank(
        f"the ranks were given different data ({sides}). fit, evaluate, predict and "
        "strategy.experimental_distribute_dataset take the same global data on every rank "
        "and give each rank its share of every batch: pass the same arrays or dataset to every "
        f"rank{parts}, shuffled with the same seed{seeds}; to give each rank data of its own, "
        "use strategy.distribute_datasets_from_function.",
        lambda: gather(description))


def global_batch_tensors(batch):
    """``batch`` (a nested structure of arrays, tensors and None, as Keras' ``*_on_batch``
    methods take it) with every array converted to a tensor, for :func:`slice_for_rank`."""
    return tf.nest.map_structure(
        lambda v: v if v is None or tf.is_tensor(v) else tf.convert_to_tensor(v), batch)


def describe_batch(batch) -> list:
    """What tells the ranks' batches apart, cheaply: for each tensor of ``batch``
    (:func:`global_batch_tensors`), its dtype, its shape and a digest of at most 64 of its
    values, evenly spaced (None for None)."""
    def leaf(value):
        if value is None:
            return None
        flat = (value.values if isinstance(value, tf.SparseTensor) else value.flat_values
                if isinstance(value, tf.RaggedTensor) else tf.reshape(value, [-1]))
        n = int(tf.size(flat))
        picked = tf.gather(flat, np.unique(np.linspace(0, n - 1, min(n, 64), dtype=np.int64)))
        digest = hashlib.blake2b(repr(picked.numpy().tolist()).encode(), digest_size=8)
        return value.dtype.name, str(value.shape), digest.hexdigest()
    return [leaf(v) for v in tf.nest.flatten(batch)]


def check_same_batch(method: str, description: list, gather: Callable[[list], list]) -> None:
    """Raises ValueError on every rank if the ranks gave ``method`` (``train_on_batch``,
    ``test_on_batch``, ``predict_on_batch``) different batches (:func:`describe_batch`).
    ``gather`` is a collective, as :func:`check_same_input`'s."""
    everyone = gather(description)
    if all(d == everyone[0] for d in everyone):
        return
    shapes = [[leaf[1] for leaf in d if leaf] for d in everyone]
    sides = "; ".join(f"rank {r}: {', '.join(s)}" for r, s in enumerate(shapes))
    what = (f"batches of different shapes ({sides})" if any(s != shapes[0] for s in shapes)
            else f"different batches (of the same shapes, {', '.join(shapes[0])}; other values)")
    _refuse_on_every_rank(
        f"the ranks gave {method} {what}. Under PoseidonStrategy, train_on_batch, test_on_batch "
        "and predict_on_batch take the global batch, the same on every rank, as fit does, and "
        "each rank runs its share of the rows: pass every rank the same batch (for batches "
        "drawn at random, seed NumPy alike on every rank, e.g. keras.utils.set_random_seed); "
        "to train each rank on data of its own, use fit on "
        "strategy.distribute_datasets_from_function.",
        lambda: gather(description))


def _refuse_on_every_rank(message: str, meet: Callable[[], object]) -> None:
    """Prints ``message`` on this rank, meets the other ranks (``meet``: the collective the
    check made, once more), then raises it: so every rank's output has the message before the
    first rank to raise aborts the job."""
    sys.stderr.write(f"[tf_poseidon rank {world.rank()}] ValueError: {message}\n")
    sys.stderr.flush()
    meet()
    raise ValueError(f"tf_poseidon: {message}")


def agreed_permutation_seeds(broadcast_from_rank0: Callable[[tuple], tuple]) -> Iterator[int]:
    """The graph seed to build each epoch's shuffled dataset of arrays under (``fit(x, y,
    shuffle=True)``; epochs 0, 1, ...), the same on every rank.

    Every rank calls it once per shuffled input, eagerly; ``broadcast_from_rank0(value) ->
    rank 0's value`` is a collective, called once, now. Rank 0 decides, as one process would:

    * with a global TensorFlow seed (``keras.utils.set_random_seed`` sets one), that seed in
      every epoch. Keras traces the permutation under the global seed, so one process draws
      the same permutation in every epoch and every ``fit`` (TensorFlow re-seeds a dataset
      function's random ops with each new iterator); so does every rank, the one process's.
    * without one, one process draws a fresh permutation per epoch: rank 0 takes fresh entropy
      and each epoch's seed is :func:`epoch_seed` of it.
    """
    seed, entropy = broadcast_from_rank0((context.global_seed(), secrets.randbits(31)))
    if seed is not None:
        return itertools.repeat(seed)
    return (epoch_seed(entropy, epoch) for epoch in itertools.count())


def epoch_seed(base: int, epoch: int) -> int:
    """The 31-bit seed of epoch ``epoch`` of an input drawn from ``base``: different for every
    epoch, the same on every rank."""
    return int(np.random.SeedSequence([base, epoch]).generate_state(1)[0]) & 0x7FFFFFFF


def agreed_python_random(broadcast_from_rank0: Callable[[object], object]) -> random.Random:
    """A generator in the state of rank 0's Python ``random`` module now, on every rank.

    Every rank calls it, eagerly; ``broadcast_from_rank0`` is a collective, called once, now.
    """
    generator = random.Random()
    generator.setstate(broadcast_from_rank0(random.getstate()))
    return generator


class AgreedBatchOrder(keras.utils.PyDataset):
    """A finite ``keras.utils.PyDataset`` whose batches are served in the order one process
    would serve them, the same on every rank, a new one for every pass over them.

    Keras shuffles a PyDataset's batches with Python's global ``random`` module, whose state is
    each process's own: the ranks would take their slices of different global batches at the
    same step. This wrapper takes over that shuffle (Keras' own is turned off): each pass
    starts with :meth:`begin_pass`, which shuffles the batch indices as Keras does, with
    ``generator`` (:func:`agreed_python_random`: rank 0's ``random`` when ``fit`` started), and
    leaves this rank's ``random`` in the generator's state, as Keras' shuffle would have left
    rank 0's. These are one process's orders where nothing else draws from ``random`` during
    ``fit``; draws between passes (a PyDataset's ``on_epoch_end`` that shuffles with
    ``random``, say) are not in the generator's sequence, so the orders then differ from one
    process's, still alike on every rank. ``batches`` is the user's PyDataset, left unchanged.
    """

    def __init__(self, batches: keras.utils.PyDataset, generator: random.Random):
        super().__init__(workers=batches.workers, use_multiprocessing=batches.use_multiprocessing,
                         max_queue_size=batches.max_queue_size)
        self.batches, self.generator = batches, generator
        self.order = list(range(batches.num_batches))

    def begin_pass(self) -> None:
        """Draws the next pass's order. Called before the pass fetches a batch (by the thread
        that starts it); not while another pass fetches."""
        self.order = list(range(self.batches.num_batches))
        self.generator.shuffle(self.order)
        random.setstate(self.generator.getstate())

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int):
        return self.batches[self.order[index]]

    def on_epoch_begin(self) -> None:
        self.batches.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.batches.on_epoch_end()


@contextlib.contextmanager
def tracing_seed(seed: int):
    """Within it (eagerly, this thread), functions traced take ``seed`` as their graph-level
    seed, so their unseeded random ops (Keras' ``tf.random.shuffle`` of the sample indices)
    draw the same numbers in every process; nothing else of the global random state changes.

    ``tf.random.set_seed`` would also restart the eager random sequence and clear the kernel
    cache, so the context's seed field is set directly and restored on exit.
    """
    ctx = context.context()
    outer = ctx._seed  # pylint: disable=protected-access
    ctx._seed = seed  # pylint: disable=protected-access
    try:
        yield
    finally:
        ctx._seed = outer  # pylint: disable=protected-access
