"""The two renames: gpupar.strategy(...) for tf.distribute's constructor, gpupar.fit(model, ...) for model.fit(...).

A script written to Keras' multi-GPU guide makes one strategy, builds and compiles under its
scope, and fits the model as often as it likes; each test here is such a script, checked
numerically where a claim is numerical (SGD, under which a wrong scale would show).
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import gpupar
from conftest import ROOT
from gpupar.errors import GpuparError

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, (x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32")


def _built(learning_rate=0.1, seed=1):
    keras.utils.set_random_seed(seed)
    base = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh")], name="base")
    model = keras.Sequential([base, keras.layers.Dense(3, name="head")], name="classifier")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss=LOSS, metrics=["accuracy"])
    return model


def _fit(model, epochs=1, **options):
    x, y = _data()
    return gpupar.fit(model, x, y, batch_size=32, epochs=epochs, shuffle=False, save=False, **{"verbose": 0, **options})


def _max_difference(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))


def test_the_strategy_is_the_same_object_for_the_same_options():
    strategy = gpupar.strategy("mirrored", virtual_cpus=2)
    assert isinstance(strategy, tf.distribute.MirroredStrategy) and strategy.num_replicas_in_sync == 2
    assert gpupar.strategy("mirrored", virtual_cpus=2) is strategy
    assert gpupar.strategy("one_device") is not strategy


def test_a_model_built_under_the_strategy_trains_as_it_is_and_as_on_one_device():
    strategy = gpupar.strategy("mirrored", virtual_cpus=2)
    with strategy.scope():
        model = _built()
    result = _fit(model)
    assert result.model is model and result.replicas == 2
    one = _fit(_built(), strategy="one_device")  # built outside any strategy: trains as it is on one device
    assert one.replicas == 1
    assert _max_difference(model.get_weights(), one.model.get_weights()) < 1e-5
    assert _max_difference(model.get_weights(), _built().get_weights()) > 1e-3  # it did train


def test_fitting_again_continues_as_one_longer_fit():
    strategy = gpupar.strategy("mirrored", virtual_cpus=2)
    with strategy.scope():
        twice, once = _built(), _built()
    _fit(twice)
    _fit(twice)
    _fit(once, epochs=2)
    assert int(twice.optimizer.iterations.numpy()) == int(once.optimizer.iterations.numpy()) == 8
    assert _max_difference(twice.get_weights(), once.get_weights()) < 1e-6


def test_transfer_learning_freezes_then_fine_tunes_the_base():
    strategy = gpupar.strategy("mirrored", virtual_cpus=2)
    with strategy.scope():
        model = _built()
    base = model.get_layer("base")
    base.trainable = False
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS, metrics=["accuracy"])
    before = [w.copy() for w in base.get_weights()]
    _fit(model)
    assert _max_difference(before, base.get_weights()) == 0.0  # frozen stays frozen
    base.trainable = True
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS, metrics=["accuracy"])  # a low rate
    _fit(model)
    assert _max_difference(before, base.get_weights()) > 0


def test_a_model_from_one_fit_trains_inside_the_next():
    """A trained teacher (a fit's result.model) inside a new model: its variables belong to the shared strategy."""
    first = _fit(_built, strategy="mirrored", virtual_cpus=2)

    def student():
        x = keras.Input((6,))
        model = keras.Model(x, keras.layers.Dense(3)(first.model.get_layer("base")(x)))
        model.compile(optimizer="adam", loss=LOSS)
        return model

    second = _fit(student, strategy="mirrored", virtual_cpus=2)
    assert second.strategy is first.strategy and np.isfinite(second.history["loss"][0])


def test_a_model_built_outside_for_several_devices_is_rebuilt_and_trained_in_place(caplog):
    caplog.set_level("INFO", "gpupar")
    model = _built()
    reference = _fit(_built(), strategy="one_device")
    result = _fit(model, strategy="mirrored", virtual_cpus=2, verbose=2)
    assert result.model is model and result.replicas == 2
    assert "was built outside any strategy, so its variables are made again under this one" in caplog.text
    assert _max_difference(model.get_weights(), reference.model.get_weights()) < 1e-5  # the trained weights came back


def test_models_that_cannot_train_as_they_are_get_one_line_before_any_step():
    for model, options, message in [
        (_built(), dict(strategy="model_parallel", stages=("base",), virtual_cpus=2),
         "strategy=model_parallel places the variables as it builds the model; pass a function"),
        (_built(), dict(precision="mixed_bfloat16"), "call keras.config.set_dtype_policy('mixed_bfloat16') before"),
    ]:
        with pytest.raises(GpuparError) as e:
            _fit(model, **options)
        assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(GpuparError, match="strategy=model_parallel places the variables as it builds the model"):
        gpupar.strategy("model_parallel")


def test_logical_devices_the_script_configured_itself_are_used():
    """conftest.py configures four logical CPUs itself, as TensorFlow's docs do: mirrored takes them all."""
    assert len(tf.config.list_logical_devices("CPU")) == 4
    assert gpupar.strategy("mirrored").num_replicas_in_sync == 4


def test_a_fit_without_options_takes_the_process_strategys():
    strategy = gpupar.strategy("mirrored", virtual_cpus=2)
    assert _fit(_built).strategy is strategy  # a model_fn too


KERAS_GUIDE = """
import sys
import keras, numpy as np
import gpupar

strategy = gpupar.strategy("mirrored", virtual_cpus=2)  # was: tf.distribute.MirroredStrategy()
print("replicas:", strategy.num_replicas_in_sync)
x = np.random.default_rng(0).normal(size=(128, 6)).astype("float32"); y = (x[:, 0] > 0).astype("int32")
dataset = __import__("tensorflow").data.Dataset.from_tensor_slices((x, y)).batch(32)  # TensorFlow runs here
with strategy.scope():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
gpupar.fit(model, dataset, epochs=2, verbose=0, save=False)  # was: model.fit(dataset, epochs=2)
print("trained:", model.optimizer.iterations.numpy())
"""


@pytest.mark.slow
def test_a_script_written_to_keras_multi_gpu_guide_runs_with_two_renames(tmp_path):
    script = tmp_path / "guide.py"
    script.write_text(textwrap.dedent(KERAS_GUIDE))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "replicas: 2" in done.stdout and "trained: 8" in done.stdout
