"""The benchmarks' models and their synthetic data (as Horovod's synthetic benchmark: one random
batch with fixed random labels, fed every step). Keras is imported only when a model is built.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    title: str
    input_shape: tuple[int, ...]
    classes: int
    params: int  # checked against the built model in tests/test_benchmark_suite.py
    fc_heavy: bool = False  # the goal for FC-heavy models is 5× MWMS, for CNNs 2×
    hidden: tuple[int, ...] = ()  # an MLP's hidden Dense widths; () for a keras.applications one
    vocabulary: int = 0  # rows of an Embedding of 64 looking up the int32 inputs; 0: none


def mlp(width: int, layers: int, name: str = "mlp", inputs: int | None = None,
        classes: int = 10, title: str = "", fc_heavy: bool = False) -> ModelSpec:
    """``layers`` hidden Dense(``width``) layers on ``inputs`` (default ``width``) features."""
    sizes = [inputs or width, *[width] * layers, classes]
    return ModelSpec(name, title or f"MLP {layers}×Dense({width})", (sizes[0],), classes,
                     sum(a * b + b for a, b in zip(sizes, sizes[1:])), fc_heavy, (width,) * layers)


MODELS: dict[str, ModelSpec] = {  # in the order of the tables
    "fc": mlp(4096, 2, "fc", 25088, 1000, "VGG-16 head (FC, 123.6 M)", fc_heavy=True),
    "vgg": ModelSpec("vgg", "VGG-16 64×64 (44.0 M)", (64, 64, 3), 1000, 43_985_704),
    "resnet": ModelSpec("resnet", "ResNet-50 64×64 (25.6 M)", (64, 64, 3), 1000, 25_636_712),
    # A recommender: nearly all parameters in one table, 8 ids per example (sparse gradients).
    "embedding": ModelSpec("embedding", "Embedding(1M, 64) + MLP (64.0 M)", (8,), 2,
                           1_000_000 * 64 + (8 * 64 * 64 + 64) + (64 * 2 + 2), False, (64,),
                           vocabulary=1_000_000),
    "tiny": mlp(32, 1, "tiny", 64, 10, "tiny MLP (smoke test)"),
}


def build(spec: ModelSpec):
    """A fresh, uncompiled Keras model of ``spec`` (build it in a strategy's scope)."""
    import keras
    if not spec.hidden:
        application = {"vgg": keras.applications.VGG16, "resnet": keras.applications.ResNet50}
        return application[spec.name](weights=None, input_shape=spec.input_shape,
                                      classes=spec.classes)
    inputs = [keras.Input(spec.input_shape, dtype="int32"), keras.layers.Embedding(
        spec.vocabulary, 64, name="table"), keras.layers.Flatten()] if spec.vocabulary \
        else [keras.Input(spec.input_shape)]
    return keras.Sequential(
        inputs + [keras.layers.Dense(w, activation="relu", name=f"fc{i + 1}")
                  for i, w in enumerate(spec.hidden)]
        + [keras.layers.Dense(spec.classes, activation="softmax", name="predictions")],
        name=spec.name)


def synthetic_batch(spec: ModelSpec, rows: int, seed: int = 0):
    """(x, y): ``rows`` float32 N(0, 1) inputs (uniform int32 ids for a model with an
    Embedding) and int32 labels in [0, classes), the same for the same arguments."""
    import numpy as np
    rng = np.random.default_rng(seed)
    x = (rng.integers(0, spec.vocabulary, size=(rows, *spec.input_shape), dtype=np.int32)
         if spec.vocabulary else rng.standard_normal((rows, *spec.input_shape), np.float32))
    return x, rng.integers(0, spec.classes, size=(rows,), dtype=np.int32)
