"""Real Keras programs that nobody here wrote (keras-io's examples, shrunk: tests/keras_io/), ported two ways.

By the two renames, as a script written to Keras' multi-GPU guide ports: the strategy's
constructor becomes gpupar.strategy(...), its `with strategy.scope():` build stays, and
model.fit( becomes gpupar.fit(model, ; nothing else changes. By the model_fn rule: the model's
build and compile move into model_fn, and model.fit( becomes gpupar.fit(model_fn, . Each runs
on 2 replicas beside Keras' own model.fit on one device; both must train and log the same names,
with finite numbers. A port that also offers script(strategy, fit, workdir) (the example's
program written to Keras' guide) is ported by the two renames in tests/test_keras_io_scripts.py,
which also holds it to Keras' names and accuracy: the same fit of the same model and data, so
not run twice.
"""

import functools
import importlib

import keras
import numpy as np
import pytest

import gpupar
import keras_io

# The ports with model_fn + train (one model, one fit); the others offer only script(strategy, fit, workdir),
# which tests/test_keras_io_scripts.py runs.
EXAMPLES = keras_io.ports("model_fn")
# The two-renames port of these is tests/test_keras_io_scripts.py's (the module docstring says why).
WITH_SCRIPT = set(keras_io.ports("script"))
SLOW = {"mobilenetv2_from_scratch", "image_classification_from_scratch",  # over 10 s each here
        "oxford_pets_image_segmentation", "bidirectional_lstm_imdb", "classification_with_grn_and_vsn"}


def _param(name):
    return pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])


@pytest.mark.parametrize("name", [_param(n) for n in EXAMPLES])
def test_a_keras_io_example_ports_by_the_rule(name, tmp_path):
    example = importlib.import_module(f"keras_io.{name}")
    for run in ("keras", "gpupar"):
        (tmp_path / run).mkdir()
    keras.utils.set_random_seed(0)
    theirs = example.train(example.model_fn().fit, str(tmp_path / "keras"))
    keras.utils.set_random_seed(0)
    ours = example.train(functools.partial(gpupar.fit, example.model_fn, strategy="mirrored", virtual_cpus=2,
                                           save=False), str(tmp_path / "gpupar"))
    assert ours.replicas == 2
    assert set(ours.history) == set(theirs.history), name  # the same logs, under Keras' names
    assert len(ours.epoch) == len(theirs.epoch)
    for log_name, values in ours.history.items():
        assert np.all(np.isfinite(values)), (name, log_name)


@pytest.mark.parametrize("name", [_param(n) for n in EXAMPLES if n not in WITH_SCRIPT])
def test_a_keras_io_example_ports_by_two_renames(name, tmp_path):
    example = importlib.import_module(f"keras_io.{name}")
    keras.utils.set_random_seed(0)
    strategy = gpupar.strategy("mirrored", virtual_cpus=2)  # was: tf.distribute.MirroredStrategy([cpu:0, cpu:1])
    with strategy.scope():
        model = example.model_fn()
    result = example.train(functools.partial(gpupar.fit, model), str(tmp_path))  # was: model.fit
    assert result.replicas == 2 and result.model is model
    assert result.history and all(np.all(np.isfinite(values)) for values in result.history.values()), name


def test_at_least_ten_examples_are_ported():
    assert len(EXAMPLES) >= 10
