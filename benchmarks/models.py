"""The benchmarks' models and their synthetic data (as Horovod's synthetic benchmark: one random
batch with fixed random labels, fed every step): ``fc`` VGG-16's classifier head
25088→4096→4096→1000 (FC-heavy), ``vgg`` and ``resnet`` keras.applications' VGG16 and
ResNet50 (weights=None) on 64×64×3 images, ``embedding`` a recommender-style model whose
parameters are nearly all one Embedding(1_000_000, 64) table (8 ids per example: its gradient
is sparse), ``tiny`` a 64→32→10 MLP for smoke tests, and :func:`mlp`. Keras is imported only
when a model is built.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    title: str
    input_shape: tuple[int, ...]
    classes: int
    params: int  # checked against the built model in tests/test_benchmark_suite.py
    fc_heavy: bool  # the goal for FC-heavy models is 5× MWMS, for CNNs 2×
    hidden: tuple[int, ...] = ()  # an MLP's hidden Dense widths; () for a keras.applications one
    vocabulary: int = 0  # rows of the Embedding the int32 ids of input_shape look up; 0: none


def _mlp(name: str, title: str, inputs: int, hidden: tuple[int, ...], classes: int,
         fc_heavy: bool = False) -> ModelSpec:
    sizes = [inputs, *hidden, classes]
    params = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    return ModelSpec(name, title, (inputs,), classes, params, fc_heavy, hidden)


def mlp(width: int, layers: int) -> ModelSpec:
    """``layers`` hidden Dense(``width``) layers on ``width`` input features, 10 classes."""
    return _mlp("mlp", f"MLP {layers}×Dense({width})", width, (width,) * layers, 10)


MODELS: dict[str, ModelSpec] = {
    "fc": _mlp("fc", "VGG-16 head (FC, 123.6 M)", 25088, (4096, 4096), 1000, fc_heavy=True),
    "vgg": ModelSpec("vgg", "VGG-16 64×64 (44.0 M)", (64, 64, 3), 1000, 43_985_704, False),
    "resnet": ModelSpec("resnet", "ResNet-50 64×64 (25.6 M)", (64, 64, 3), 1000, 25_636_712,
                        False),
    "embedding": ModelSpec("embedding", "Embedding(1M, 64) + MLP (64.0 M)", (8,), 2,
                           1_000_000 * 64 + (8 * 64 * 64 + 64) + (64 * 2 + 2), False, (64,),
                           vocabulary=1_000_000),
    "tiny": _mlp("tiny", "tiny MLP (smoke test)", 64, (32,), 10),
}


def build(spec: ModelSpec):
    """A fresh, uncompiled Keras model of ``spec`` (build it in a strategy's scope)."""
    import keras
    if spec.hidden:
        inputs = [keras.Input(spec.input_shape, dtype="int32"), keras.layers.Embedding(
            spec.vocabulary, 64, name="table"), keras.layers.Flatten()] if spec.vocabulary \
            else [keras.Input(spec.input_shape)]
        return keras.Sequential(
            inputs + [keras.layers.Dense(w, activation="relu", name=f"fc{i + 1}")
                      for i, w in enumerate(spec.hidden)]
            + [keras.layers.Dense(spec.classes, activation="softmax", name="predictions")],
            name=spec.name)
    application = {"vgg": keras.applications.VGG16, "resnet": keras.applications.ResNet50}
    return application[spec.name](weights=None, input_shape=spec.input_shape,
                                  classes=spec.classes)


def synthetic_batch(spec: ModelSpec, rows: int, seed: int = 0):
    """(x, y): ``rows`` float32 N(0, 1) inputs (uniform int32 ids for a model with an
    Embedding) and int32 labels in [0, classes), the same for the same arguments."""
    import numpy as np
    rng = np.random.default_rng(seed)
    x = (rng.integers(0, spec.vocabulary, size=(rows, *spec.input_shape), dtype=np.int32)
         if spec.vocabulary else rng.standard_normal((rows, *spec.input_shape), np.float32))
    return x, rng.integers(0, spec.classes, size=(rows,), dtype=np.int32)
