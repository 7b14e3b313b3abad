"""A model built or compiled outside ``strategy.scope()`` is refused by ``fit`` with a message
that names the mistake and shows the fix, instead of TensorFlow's "Mixing different
tf.distribute.Strategy objects" / "colocate_vars_with must only be passed a variable created in
this tf.distribute.Strategy.scope()" from inside the first step (or, with an optimizer that has
no slots, ranks that silently train alone)."""

import contextlib
import re

import keras
import numpy as np
import pytest

import tf_poseidon as tp
from multirank import run_job

X = np.random.default_rng(0).normal(size=(64, 10)).astype("float32")
Y = (X[:, 0] > 0).astype("int32")
FIX = ("Build and compile the model under strategy.scope(), then call fit:\n"
       "    with strategy.scope():\n"
       "        model = make_model()\n"
       "        model.compile(optimizer=..., loss=...)\n"
       "    model.fit(...)")


def make_model() -> keras.Model:
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(4, activation="relu"),
                             keras.layers.Dense(2)])


def compile_model(model: keras.Model, optimizer: str) -> None:
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.parametrize("built_inside, compiled_inside, fit_inside, optimizer, problem", [
    # Keras numbers the layers of every model a process builds: sequential_3/dense_6/...
    (False, True, False, "adam", r"its variables were created outside strategy.scope\(\) "
                                 r"\(first: sequential(_\d+)?/dense(_\d+)?/kernel\)"),
    (False, True, True, "adam", r"its variables were created outside strategy.scope\(\)"),
    (False, False, True, "adam", r"its variables were created outside strategy.scope\(\)"),
    (False, True, False, "sgd", r"its variables were created outside strategy.scope\(\)"),
    (True, False, False, "adam", r"its optimizer was created outside strategy.scope\(\)"),
    (True, False, True, "adam", r"its optimizer was created outside strategy.scope\(\)"),
])
def test_fit_names_the_mistake_and_the_fix(built_inside, compiled_inside, fit_inside, optimizer,
                                           problem):
    strategy = tp.PoseidonStrategy()

    def scope(inside: bool):
        return strategy.scope() if inside else contextlib.nullcontext()

    with scope(built_inside):
        model = make_model()
    with scope(compiled_inside):
        compile_model(model, optimizer)
    with scope(fit_inside), pytest.raises(ValueError) as raised:
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    message = str(raised.value)
    assert re.search(problem, message), message
    assert message.endswith(FIX), message


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_an_optimizer_made_outside_the_scope_is_named(optimizer):
    strategy = tp.PoseidonStrategy()
    made_outside = keras.optimizers.get(optimizer)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=made_outside, loss="mse")
    with pytest.raises(ValueError, match=r"its optimizer was created outside strategy.scope\(\)"):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0)


def test_models_of_the_strategy_and_plain_models_train():
    strategy = tp.PoseidonStrategy()
    with strategy.scope():
        model = make_model()
        compile_model(model, "adam")
    assert len(model.fit(X, Y, batch_size=16, epochs=1, verbose=0).history["loss"]) == 1
    plain = make_model()  # no strategy at all: plain Keras, untouched by the check
    compile_model(plain, "adam")
    assert len(plain.fit(X, Y, batch_size=16, epochs=1, verbose=0).history["loss"]) == 1


@pytest.mark.multirank
def test_two_ranks_end_promptly_with_the_message():
    result, seconds = run_job(2, "misbehave.py", "outside_scope", timeout=120)
    assert result.returncode != 0 and seconds < 60, result.stdout
    assert "ValueError: tf_poseidon: the model cannot be trained with PoseidonStrategy: its " \
           "variables were created outside strategy.scope()" in result.stdout, result.stdout
    assert "Mixing different" not in result.stdout and "colocate_vars_with" not in result.stdout
