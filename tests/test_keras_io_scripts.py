"""The keras-io ports' `script(strategy, fit, workdir)` entry point, run with Keras alone.

`script` is the example's program written the way Keras' multi-GPU guide writes it (what makes
variables under `strategy.scope()`, every `model.fit(...)` as `fit(model, ...)`), so that
`fit=keras.Model.fit` is exactly Keras. Here each such module runs with Keras' own fit on one
device and on two replicas (MirroredStrategy over two virtual CPUs); both must train, log
finite numbers and log the same names. Where Keras itself fails on two replicas for a program
as written, that parametrization is a strict xfail naming Keras' error (see
tests/keras_io/README.md). Also: importing any port runs no TensorFlow.
"""

import importlib
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import gpupar
from conftest import two_replicas
import keras_io

EXAMPLES = keras_io.ports()
SCRIPTS = keras_io.ports("script")

# 9 s or more here (a two-replica test also runs the one-device one when this process hasn't yet).
SLOW_ONE_DEVICE = {"classification_with_grn_and_vsn"}
SLOW_TWO_REPLICAS = {"knowledge_distillation_compute_loss", "text_generation_with_miniature_gpt", "transfer_learning",
                     "endpoint_layer_pattern", "neural_machine_translation_with_transformer"}

# Keras' own fit fails for these programs as written under MirroredStrategy (2 virtual CPUs, model made in
# the scope). The exception type and Keras' message; why, in tests/keras_io/README.md.
KERAS_FAILS_ON_TWO_REPLICAS = {
    "making_new_layers_and_models_via_subclassing": (
        ValueError,
        "ValueError: Exception encountered when calling Sampling.call(). tf.function only supports singleton "
        "tf.Variables created on the first call. (the unseeded keras.random.normal creates Keras' global "
        "SeedGenerator in each replica thread)"),
    "classification_with_grn_and_vsn": (
        tf.errors.InvalidArgumentError,
        "InvalidArgumentError: Value for attr 'T' of string is not in the list of allowed values ... "
        "{{node AddN}} (Keras' _maybe_symbolic_build: strategy.reduce('MEAN') of the first batch, string features)"),
    "lstm_character_level_text_generation": (
        tf.errors.InvalidArgumentError,
        "InvalidArgumentError: Value for attr 'T' of bool is not in the list of allowed values ... "
        "{{node AddN}} (Keras' _maybe_symbolic_build: strategy.reduce('MEAN') of the first batch, bool x and y)"),
}

# gpupar.fit trains these on two replicas, but Keras' own code after the fit fails there (strict xfails, Keras' error).
KERAS_FAILS_AFTER_GPUPAR_FIT = {
    "lstm_character_level_text_generation": (
        ValueError,
        "ValueError: Exception encountered when calling LSTMCell.call(). Shape must be rank 1 but is rank 2 for "
        "'{{node replica_1/.../lstm_cell_1/BiasAdd}}' (Keras' own model.predict of one example under a 2-replica "
        "strategy: replica 1 gets none, and the LSTM cell fails on an empty batch; the fits before it trained)"),
}

_ONE_DEVICE = {}  # name -> the History of Keras' one-device run in this process


def _run(name, strategy, workdir, fit=keras.Model.fit):
    example = importlib.import_module(f"keras_io.{name}")
    keras.utils.set_random_seed(0)
    return example.script(strategy, fit, str(workdir))




def _one_device(name, tmp_path_factory):
    if name not in _ONE_DEVICE:
        _ONE_DEVICE[name] = _run(name, tf.distribute.get_strategy(), tmp_path_factory.mktemp(f"{name}_one"))
    return _ONE_DEVICE[name]


def _assert_trained(name, history):
    assert history.history, name
    for log_name, values in history.history.items():
        assert np.all(np.isfinite(values)), (name, log_name, values)


def _one_device_param(name):
    return pytest.param(name, marks=pytest.mark.slow) if name in SLOW_ONE_DEVICE else name


def _two_replicas_param(name):
    marks = [pytest.mark.slow] if name in SLOW_TWO_REPLICAS else []
    if name in KERAS_FAILS_ON_TWO_REPLICAS:
        raises, reason = KERAS_FAILS_ON_TWO_REPLICAS[name]
        marks.append(pytest.mark.xfail(strict=True, raises=raises, reason=reason))
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_one_device_param(n) for n in SCRIPTS])
def test_a_keras_io_script_trains_with_keras_fit_on_one_device(name, tmp_path_factory):
    _assert_trained(name, _one_device(name, tmp_path_factory))


@pytest.mark.parametrize("name", [_two_replicas_param(n) for n in SCRIPTS])
def test_a_keras_io_script_trains_with_keras_fit_on_two_replicas(name, tmp_path, tmp_path_factory):
    strategy = two_replicas()
    assert strategy.num_replicas_in_sync == 2
    history = _run(name, strategy, tmp_path)
    _assert_trained(name, history)
    one = _one_device(name, tmp_path_factory)
    assert set(history.history) == set(one.history), name  # the same logs as on one device
    assert len(history.epoch) == len(one.epoch)


ACCURACY = ("val_accuracy", "accuracy", "val_sparse_categorical_accuracy", "sparse_categorical_accuracy",
            "val_binary_accuracy", "binary_accuracy")


def _two_renames_param(name):
    marks = [pytest.mark.slow] if name in SLOW_TWO_REPLICAS | SLOW_ONE_DEVICE else []
    if name in KERAS_FAILS_AFTER_GPUPAR_FIT:
        raises, reason = KERAS_FAILS_AFTER_GPUPAR_FIT[name]
        marks.append(pytest.mark.xfail(strict=True, raises=raises, reason=reason))
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_two_renames_param(n) for n in SCRIPTS])
def test_a_keras_io_script_ports_by_two_renames(name, tmp_path, tmp_path_factory):
    """tf.distribute.MirroredStrategy(...) -> gpupar.strategy(...), fit(model, ...) -> gpupar.fit(model, ...): trains on
    2 replicas, logs Keras' names, and ends within 0.015 of Keras' own fit's accuracy (on one device, where every
    program trains)."""
    strategy = gpupar.strategy("mirrored", virtual_cpus=2)
    history = _run(name, strategy, tmp_path, gpupar.fit)
    _assert_trained(name, history)
    assert history.replicas == 2
    theirs = _one_device(name, tmp_path_factory).history
    assert set(history.history) == set(theirs), name
    shared = [metric for metric in ACCURACY if metric in theirs]
    for metric in shared[:1]:
        assert history.history[metric][-1] == pytest.approx(theirs[metric][-1], abs=0.015), (name, metric)


def test_the_known_keras_failures_are_of_scripts():
    assert set(KERAS_FAILS_ON_TWO_REPLICAS) <= set(SCRIPTS)
    assert len(SCRIPTS) >= 6


_IMPORT_CHECK = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
from tensorflow.python.eager import context
from keras.src.backend.common import global_state
found = {}
for name in json.loads(sys.argv[2]):
    importlib.import_module("keras_io." + name)
    named = dict(global_state.get_global_attribute("object_name_uids") or {})
    if context.context()._initialized or named:
        found[name] = {"tensorflow_runtime_initialized": context.context()._initialized, "keras_objects": named}
        break
print(json.dumps(found))
"""


def test_importing_a_keras_io_module_runs_no_tensorflow():
    """In a fresh interpreter, importing every port leaves TensorFlow's runtime uninitialised and makes no Keras object."""
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", _IMPORT_CHECK, tests, json.dumps(EXAMPLES)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}  # the first module that did, if any
