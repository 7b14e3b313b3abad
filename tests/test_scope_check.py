"""A model built or compiled outside ``strategy.scope()`` is refused by ``fit`` with a message
that names the mistake and shows the fix, instead of TensorFlow's "Mixing different
tf.distribute.Strategy objects" / "colocate_vars_with must only be passed a variable created in
this tf.distribute.Strategy.scope()" from inside the first step (or, with an optimizer that has
no slots, ranks that silently train alone). A model under no strategy at all trains as plain
Keras; in a job of several ranks rank 0 warns that each rank trains its own copy (here, and in
the verbose job of tests/test_failures_and_logging.py)."""

import contextlib
import re
import warnings

import keras
import numpy as np
import pytest

import tf_poseidon as tp
from multirank import run_job
from tf_poseidon import scope_check

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


def test_a_model_under_no_strategy_in_a_job_of_several_ranks_gets_a_warning_on_rank_0():
    plain = make_model()
    compile_model(plain, "adam")
    with pytest.warns(UserWarning) as warned:
        scope_check.warn_if_trained_alone(plain, 2, 0)
    assert len(warned) == 1 and str(warned[0].message).startswith(
        "tf_poseidon: fit in a job of 2 ranks on a model built outside strategy.scope(): each "
        "rank trains its own copy on all of the data, exchanging nothing."), warned[0].message
    assert str(warned[0].message).endswith(
        "build and compile it under the scope of a PoseidonStrategy, then call fit:\n"
        + FIX.split(":\n", 1)[1])
    strategy = tp.PoseidonStrategy()
    with strategy.scope():
        distributed = make_model()
        compile_model(distributed, "adam")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scope_check.warn_if_trained_alone(plain, 2, 1)  # rank 0 alone says it
        scope_check.warn_if_trained_alone(plain, 1, 0)  # one process: plain Keras
        scope_check.warn_if_trained_alone(distributed, 2, 0)
        with strategy.scope():  # fit in a scope: check_model_in_scope's to refuse
            scope_check.warn_if_trained_alone(plain, 2, 0)


@pytest.mark.multirank
def test_two_ranks_end_promptly_with_the_message():
    result, seconds = run_job(2, "misbehave.py", "outside_scope", timeout=120)
    assert result.returncode != 0 and seconds < 60, result.stdout
    assert "ValueError: tf_poseidon: the model cannot be trained with PoseidonStrategy: its " \
           "variables were created outside strategy.scope()" in result.stdout, result.stdout
    assert "Mixing different" not in result.stdout and "colocate_vars_with" not in result.stdout
