"""The examples' data: the 8×8 handwritten digits of examples/data/ (no scikit-learn needed).

``load_digits`` gives what ``sklearn.datasets.load_digits()`` gives (images and labels), and
``load_data(seed)`` the split ``sklearn.model_selection.train_test_split(x, y, test_size=0.25,
random_state=seed, stratify=y)`` makes (scikit-learn 1.9's algorithm, reproduced exactly, so the
accuracies in the docs and tests stay those measured with it).
"""

from __future__ import annotations

import math
import os

import numpy as np

DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as (images, labels): float64 pixel counts in 0..16 of shape
    [1797, 8, 8], and int64 labels in 0..9 (examples/data/README.md)."""
    table = np.loadtxt(DIGITS, delimiter=",", dtype=np.int64)
    return table[:, :-1].reshape(-1, 8, 8).astype(np.float64), table[:, -1]


def load_data(seed: int = 0):
    """Digits as (x_train, y_train, x_test, y_test): 8×8×1 float32 images in [0, 1], int32
    labels; a stratified quarter of them, drawn with ``seed``, is the test set."""
    images, labels = load_digits()
    x, y = (images / 16.0).astype("float32")[..., None], labels.astype("int32")
    train, test = stratified_split(y, 0.25, seed)
    return x[train], y[train], x[test], y[test]


def stratified_split(labels: np.ndarray, test_size: float, seed: int):
    """(train indices, test indices) as scikit-learn's StratifiedShuffleSplit draws them."""
    rng = np.random.RandomState(seed)
    n_test = math.ceil(test_size * len(labels))
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    members = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    n_train_i = _approximate_mode(counts, len(labels) - n_test, rng)
    n_test_i = _approximate_mode(counts - n_train_i, n_test, rng)
    train, test = [], []
    for indices, a, b in zip(members, n_train_i, n_test_i):
        shuffled = indices.take(rng.permutation(len(indices)), mode="clip")
        train.extend(shuffled[:a])
        test.extend(shuffled[a:a + b])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of ``draws`` to take from each class: the floor of the proportional share,
    then one more for the largest remainders, ties broken at random."""
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    missing = int(draws - floored.sum())
    remainder = continuous - floored
    for value in np.sort(np.unique(remainder))[::-1]:
        if missing <= 0:
            break
        (tied,) = np.where(remainder == value)
        chosen = rng.choice(tied, size=min(len(tied), missing), replace=False)
        floored[chosen] += 1
        missing -= len(chosen)
    return floored.astype(int)
