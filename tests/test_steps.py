"""The kinds of step: chosen from the model and the placement, and a fourth kind as one class and one registration."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import gpupar
from gpupar.errors import GpuparError
from gpupar.training import steps
from gpupar.training.inner_loop import unpack
from gpupar.training.steps.compiled import KerasCompiledStep

RATE = 0.25


class SignStep(KerasCompiledStep):
    """Sign descent, a kind gpupar does not have: each weight moves by RATE against the sign of its gradient."""

    def train_step(self, batch, states):
        x, y, _ = unpack(batch)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self.model(x, training=True) - y))
        for variable, gradient in zip(self.model.trainable_variables,
                                      tape.gradient(loss, self.model.trainable_variables)):
            variable.assign_sub(RATE * tf.sign(gradient))
        self.optimizer.iterations.assign_add(1)  # the update counter that checkpoints and the loop read
        rows = tf.cast(tf.shape(x)[0], tf.float32)
        return (loss * rows, rows), states


class SignKind(steps.StepKind):
    """Trains the models that ask for sign descent (a `sign_descent` attribute)."""

    name = "sign"

    def applies(self, model, placement) -> bool:
        return getattr(model, "sign_descent", False)

    def refusal(self, model, mode, options):
        return None if options.accumulate_steps == 1 else "sign descent adds up no gradients: use accumulate_steps=1"

    def build(self, request):
        return SignStep(request.model, request.optimizer)


def _model(sign: bool):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.sign_descent = sign
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


@pytest.fixture
def sign_kind(monkeypatch):
    monkeypatch.setattr(steps, "KINDS", list(steps.KINDS))  # the registration ends with the test
    return steps.register(SignKind())


def test_a_fourth_kind_of_step_is_one_class_and_one_registration_and_it_trains(sign_kind, tmp_path):
    x, y = np.ones((32, 2), np.float32), np.full((32, 1), 10.0, np.float32)
    model = _model(sign=True)
    result = gpupar.fit(model, x, y, batch_size=8, epochs=2, strategy="one_device", model_dir=str(tmp_path),
                        verbose=0)
    # 8 steps, each moving both weights up by RATE (the prediction is below 10 all the way): 2.0, exactly.
    np.testing.assert_array_equal(model.get_weights()[0], np.full((2, 1), 8 * RATE, np.float32))
    assert int(model.optimizer.iterations.numpy()) == 8 and len(result.records) == 2
    with pytest.raises(GpuparError, match="sign descent adds up no gradients"):
        gpupar.fit(_model(sign=True), x, y, batch_size=8, accumulate_steps=2, strategy="one_device", save=False,
                   verbose=0)


def test_the_other_models_keep_their_kind_when_a_kind_is_registered(sign_kind):
    x, y = np.ones((32, 2), np.float32), np.full((32, 1), 10.0, np.float32)
    model = _model(sign=False)
    gpupar.fit(model, x, y, batch_size=8, epochs=1, strategy="one_device", save=False, verbose=0)
    # SGD on the mean squared error: the first step moves each weight by 0.01 * 2 * 10 = 0.2, not by RATE.
    assert 0.2 <= float(model.get_weights()[0][0, 0]) < 4 * 0.2 * 1.001


def test_the_kind_is_the_first_that_applies_and_its_refusal_is_the_error():
    from gpupar.config import StepOptions
    from gpupar.training.modes.model_parallel import ModelParallel
    from gpupar.training.modes.synchronous import Synchronous
    from gpupar.runtime.stages import plan_stages
    from gpupar.training.trainer import Placement

    class OwnStepModel(keras.Sequential):
        def train_step(self, data):
            return {}

    mirrored = Placement("mirrored", None, 2, ["/cpu:0", "/cpu:1"])
    staged = Placement("stages", None, 1, ["/cpu:0", "/cpu:1"], plan=plan_stages(["/cpu:0", "/cpu:1"], 2))
    sync, stages = Synchronous(gpupar.Config().distribution), ModelParallel(gpupar.Config().distribution)
    plain, own = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), OwnStepModel([keras.Input((2,))])
    assert steps.step_kind(plain, sync, mirrored, StepOptions()).name == "compiled"
    assert steps.step_kind(plain, stages, staged, StepOptions()).name == "pipelined"
    assert steps.step_kind(own, sync, mirrored, StepOptions()).name == "own"
    with pytest.raises(GpuparError, match="OwnStepModel has its own train_step, which the model_parallel mode cannot"):
        steps.step_kind(own, stages, staged, StepOptions())
    with pytest.raises(GpuparError, match="accumulate_steps=2 cannot add up its gradients"):
        steps.step_kind(own, sync, mirrored, StepOptions(accumulate_steps=2))
