"""The benchmarks' models and their synthetic data (Horovod's synthetic benchmark: one random
batch of inputs with fixed random labels, fed again every step).

| name   | model                                                        | parameters | input      |
|--------|--------------------------------------------------------------|------------|------------|
| fc     | VGG-16 classifier head 25088→4096→4096→1000 (FC-heavy)       | 123.6 M    | 25088 feat.|
| vgg    | keras.applications.VGG16(weights=None), its own FC head      | 44.0 M     | 64×64×3    |
| resnet | keras.applications.ResNet50(weights=None)                    | 25.6 M     | 64×64×3    |
| tiny   | 64→32→10 MLP, for smoke tests of the harness only            | 2.4 k      | 64 feat.   |
| mlp    | ``layers`` × Dense(``width``) → 10 (:func:`mlp`)             | varies     | width      |

Keras is imported only inside the functions, so a driver reads this table without starting
TensorFlow.
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
    hidden: tuple[int, ...] = ()  # an MLP's hidden Dense widths; () for a keras.applications one


def _mlp(name: str, title: str, inputs: int, hidden: tuple[int, ...], classes: int,
         fc_heavy: bool = False) -> ModelSpec:
    sizes = [inputs, *hidden, classes]
    params = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    return ModelSpec(name, title, (inputs,), classes, params, fc_heavy, hidden)


def mlp(width: int, layers: int) -> ModelSpec:
    """``layers`` hidden Dense(``width``) layers on ``width`` input features, 10 classes."""
    return _mlp("mlp", f"MLP {layers}×Dense({width})", width, (width,) * layers, 10)


IMAGE = 64
MODELS: dict[str, ModelSpec] = {
    "fc": _mlp("fc", "VGG-16 head (FC, 123.6 M)", 25088, (4096, 4096), 1000, fc_heavy=True),
    "vgg": ModelSpec("vgg", f"VGG-16 {IMAGE}×{IMAGE} (44.0 M)", (IMAGE, IMAGE, 3), 1000,
                     43_985_704, False),
    "resnet": ModelSpec("resnet", f"ResNet-50 {IMAGE}×{IMAGE} (25.6 M)", (IMAGE, IMAGE, 3),
                        1000, 25_636_712, False),
    "tiny": _mlp("tiny", "tiny MLP (smoke test)", 64, (32,), 10),
}


def build(spec: ModelSpec):
    """A fresh, uncompiled Keras model of ``spec``. Call inside a strategy scope to create its
    variables there."""
    import keras
    if spec.hidden:
        return keras.Sequential(
            [keras.Input(spec.input_shape)]
            + [keras.layers.Dense(w, activation="relu", name=f"fc{i + 1}")
               for i, w in enumerate(spec.hidden)]
            + [keras.layers.Dense(spec.classes, activation="softmax", name="predictions")],
            name=spec.name)
    application = {"vgg": keras.applications.VGG16, "resnet": keras.applications.ResNet50}
    return application[spec.name](weights=None, input_shape=spec.input_shape,
                                  classes=spec.classes)


def synthetic_batch(spec: ModelSpec, rows: int, seed: int = 0):
    """(x, y) numpy arrays: ``rows`` random inputs (float32, N(0, 1)) and fixed random labels
    (int32 in [0, classes)); the same on every rank for the same arguments."""
    import numpy as np
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, *spec.input_shape), dtype=np.float32)
    y = rng.integers(0, spec.classes, size=(rows,), dtype=np.int32)
    return x, y
