"""The benchmark's models and their synthetic data (Horovod's synthetic benchmark: one random
batch of inputs with fixed random labels, fed again every step).

| name   | model                                                        | parameters | input      |
|--------|--------------------------------------------------------------|------------|------------|
| fc     | VGG-16 classifier head 25088→4096→4096→1000 (FC-heavy)       | 123.6 M    | 25088 feat.|
| vgg    | keras.applications.VGG16(weights=None), its own FC head      | 44.0 M     | 64×64×3    |
| resnet | keras.applications.ResNet50(weights=None)                    | 25.6 M     | 64×64×3    |
| tiny   | 64→32→10 MLP, for smoke tests of the harness only            | 2.4 k      | 64 feat.   |

Imports Keras only inside the functions, so the suite's driver can read this table without
starting TensorFlow.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the harness needs to know about a model without building it."""

    name: str
    title: str
    input_shape: tuple[int, ...]
    classes: int
    params: int  # checked against the built model in tests/test_benchmark_suite.py
    fc_heavy: bool  # the goal for FC-heavy models is 5× MWMS, for CNNs 2×


IMAGE = 64
MODELS: dict[str, ModelSpec] = {
    "fc": ModelSpec("fc", "VGG-16 head (FC, 123.6 M)", (25088,), 1000, 123_642_856, True),
    "vgg": ModelSpec("vgg", f"VGG-16 {IMAGE}×{IMAGE} (44.0 M)", (IMAGE, IMAGE, 3), 1000,
                     43_985_704, False),
    "resnet": ModelSpec("resnet", f"ResNet-50 {IMAGE}×{IMAGE} (25.6 M)", (IMAGE, IMAGE, 3),
                        1000, 25_636_712, False),
    "tiny": ModelSpec("tiny", "tiny MLP (smoke test)", (64,), 10, 64 * 32 + 32 + 32 * 10 + 10,
                      False),
}


def build(name: str):
    """A fresh, uncompiled Keras model ``name`` (see MODELS). Call inside a strategy scope to
    create its variables there."""
    import keras
    spec = MODELS[name]
    if name == "fc":
        return keras.Sequential([
            keras.Input(spec.input_shape),
            keras.layers.Dense(4096, activation="relu", name="fc1"),
            keras.layers.Dense(4096, activation="relu", name="fc2"),
            keras.layers.Dense(spec.classes, activation="softmax", name="predictions"),
        ], name="vgg16_head")
    if name == "vgg":
        return keras.applications.VGG16(weights=None, input_shape=spec.input_shape,
                                        classes=spec.classes)
    if name == "resnet":
        return keras.applications.ResNet50(weights=None, input_shape=spec.input_shape,
                                           classes=spec.classes)
    if name == "tiny":
        return keras.Sequential([
            keras.Input(spec.input_shape),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(spec.classes, activation="softmax"),
        ], name="tiny")
    raise KeyError(name)


def synthetic_batch(name: str, rows: int, seed: int = 0):
    """(x, y) numpy arrays: ``rows`` random inputs (float32, N(0, 1)) and fixed random labels
    (int32 in [0, classes)); the same on every rank for the same arguments."""
    import numpy as np
    spec = MODELS[name]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, *spec.input_shape), dtype=np.float32)
    y = rng.integers(0, spec.classes, size=(rows,), dtype=np.int32)
    return x, y
