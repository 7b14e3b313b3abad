"""Whether a Keras model about to be trained belongs to one PoseidonStrategy.

A model trains under a strategy only if it was built (its variables created) and compiled (its
optimizer created) inside that strategy's ``scope()``. Otherwise TensorFlow fails deep inside the
first step with errors that do not name the fix ("Mixing different tf.distribute.Strategy
objects", "`colocate_vars_with` must only be passed a variable created in this
tf.distribute.Strategy.scope()", "Need to be inside "with strategy.scope()""), or, for an
optimizer without slots, trains each rank on its own without a word. :func:`check_model_in_scope`
finds the mismatch before ``fit`` starts and says what to do. A model no strategy touched is
plain Keras and trains; in a job of several ranks each rank trains its own copy on all of the
data, which :func:`warn_if_trained_alone` says on rank 0: most likely a forgotten scope.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

_EXAMPLE = ("    with strategy.scope():\n"
            "        model = make_model()\n"
            "        model.compile(optimizer=..., loss=...)\n"
            "    model.fit(...)")


def check_model_in_scope(model, strategy_class: type) -> None:
    """Raises ValueError unless ``model`` is wholly one ``strategy_class`` (PoseidonStrategy)
    instance's, or none's.

    Called by ``fit`` (keras_integration.py) on every rank before anything else; no collective,
    so every rank raises alike. The model's strategy (recorded when it was constructed), its
    optimizer's (recorded at ``compile``), its variables', and the strategy whose scope ``fit``
    runs in, if any, must all be the same PoseidonStrategy. A model that no PoseidonStrategy
    touched is plain Keras and passes.
    """
    model_strategy = getattr(model, "_distribute_strategy", None)
    optimizer_strategy = getattr(getattr(model, "optimizer", None), "_distribution_strategy", None)
    current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    variables = [(v.path, getattr(getattr(v, "value", v), "_distribute_strategy", None))
                 for v in model.variables]
    involved = [model_strategy, optimizer_strategy, current] + [s for _, s in variables]
    poseidon = next((s for s in involved if isinstance(s, strategy_class)), None)
    if poseidon is None:
        return
    outside = next((path for path, s in variables if s is not poseidon), None)
    if outside is not None:
        problem = f"its variables were created outside strategy.scope() (first: {outside})"
    elif model_strategy is not poseidon:
        problem = "it was constructed outside strategy.scope()"
    elif model.optimizer is not None and optimizer_strategy is not poseidon:
        problem = ("its optimizer was created outside strategy.scope() (by compile outside it, "
                   "or as an optimizer object made outside it)")
    elif current is not None and current is not poseidon:
        problem = f"fit runs inside the scope of another strategy ({type(current).__name__})"
    else:
        return
    raise ValueError(
        f"tf_poseidon: the model cannot be trained with PoseidonStrategy: {problem}. Build and "
        f"compile the model under strategy.scope(), then call fit:\n{_EXAMPLE}")


def warn_if_trained_alone(model, world_size: int, rank: int) -> None:
    """Warns (a UserWarning, on rank 0 only) where ``fit`` is about to train ``model``, built
    and compiled under no strategy and fit outside any scope, in a job of ``world_size`` > 1
    ranks: every rank then trains its own copy on all of the data and nothing is exchanged,
    which is what a forgotten ``strategy.scope()`` does. A model each rank is meant to train
    on its own is legitimate: the warning is Python's, to be filtered as any other. Called by
    ``fit`` (keras_integration.py) after :func:`check_model_in_scope`; no collective.
    """
    if (world_size <= 1 or rank != 0 or getattr(model, "_distribute_strategy", None) is not None
            or tf.distribute.has_strategy()):
        return
    warnings.warn(
        f"tf_poseidon: fit in a job of {world_size} ranks on a model built outside "
        f"strategy.scope(): each rank trains its own copy on all of the data, exchanging "
        f"nothing. To train it data-parallel, build and compile it under the scope of a "
        f"PoseidonStrategy, then call fit:\n{_EXAMPLE}", UserWarning, stacklevel=3)
