"""The rest of Keras' semantics that real programs rely on: add_loss and a layer's own metric on several replicas, data
of unknown length, a None loss of an output, the script's own seed, class_weight for some classes."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import gpupar

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, (x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32")


def _max_difference(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(a, b))


@keras.saving.register_keras_serializable(package="gpupar_tests")
class ActivityPenalty(keras.layers.Layer):
    """Adds a penalty on its inputs' size (add_loss) and keeps their mean in a metric of its own."""

    def __init__(self, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate
        self.activation_mean = keras.metrics.Mean(name="activation_mean")

    def call(self, inputs):
        self.add_loss(self.rate * ops.mean(ops.square(inputs)))
        self.activation_mean.update_state(ops.mean(inputs, axis=-1))
        return inputs


def _penalised():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), ActivityPenalty(),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss=LOSS, metrics=["accuracy"])
    return model


def _fit(model, **options):
    x, y = _data()
    return gpupar.fit(model, x, y, batch_size=32, shuffle=False, verbose=0, save=False,
                      **{"epochs": 2, "validation_data": _data(64, 1), **options})


def test_add_loss_gives_the_same_update_on_two_replicas_as_on_one_device():
    one = _fit(_penalised, strategy="one_device")
    two = _fit(_penalised, strategy="mirrored", virtual_cpus=2)
    assert _max_difference(one.model.get_weights(), two.model.get_weights()) < 1e-5
    assert two.history["loss"] == pytest.approx(one.history["loss"], rel=1e-5)
    # Control: without the penalty the update is another one.
    plain = _fit(lambda: keras.Sequential([layer for layer in _penalised().layers if not isinstance(
        layer, ActivityPenalty)]), strategy="one_device", loss=LOSS, optimizer=lambda: keras.optimizers.SGD(0.2))
    assert _max_difference(one.model.get_weights(), plain.model.get_weights()) > 1e-4


def test_a_layers_own_metric_is_logged_as_keras_logs_it():
    x, y = _data()
    theirs = _penalised()
    keras_history = theirs.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                               validation_data=_data(64, 1)).history
    ours = _fit(_penalised, strategy="mirrored", virtual_cpus=2).history
    for name in ("activation_mean", "val_activation_mean"):
        assert ours[name] == pytest.approx(keras_history[name], abs=1e-5), name


def test_a_dataset_of_unknown_length_trains_one_pass_per_epoch():
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(32)
    assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    result = gpupar.fit(_penalised, dataset, epochs=2, verbose=0, save=False)
    assert [record.steps for record in result.records] == [4, 4]  # 128 examples in batches of 32, as Keras runs it


def _two_outputs():
    keras.utils.set_random_seed(2)
    x = keras.Input((6,))
    features = keras.layers.Dense(8, activation="tanh", name="features")(x)
    model = keras.Model(x, [keras.layers.Dense(3, name="logits")(features), features])
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss=[LOSS, None])
    return model


def test_a_none_loss_leaves_its_output_out_and_one_y_goes_to_the_other():
    x, y = _data()
    theirs = _two_outputs()
    keras_loss = theirs.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history["loss"]
    ours = gpupar.fit(_two_outputs, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, save=False,
                      strategy="mirrored", virtual_cpus=2)
    assert ours.history["loss"] == pytest.approx(keras_loss, rel=1e-4)
    assert _max_difference(ours.model.get_weights(), theirs.get_weights()) < 1e-5


def test_the_scripts_own_seed_is_kept_and_seed_sets_it():
    def unseeded():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=LOSS)
        return model

    keras.utils.set_random_seed(5)
    expected = unseeded().get_weights()
    keras.utils.set_random_seed(5)
    kept = gpupar.fit(unseeded, *_data(), epochs=0, verbose=0, save=False).model.get_weights()
    assert _max_difference(kept, expected) == 0.0
    keras.utils.set_random_seed(5)
    reseeded = gpupar.fit(unseeded, *_data(), epochs=0, verbose=0, save=False, seed=3).model.get_weights()
    assert _max_difference(reseeded, expected) > 0  # seed= seeds Keras, as gpupar did before


def test_a_class_that_class_weight_does_not_name_weighs_one():
    some = _fit(_penalised, class_weight={0: 3.0}, validation_data=None)
    every = _fit(_penalised, class_weight={0: 3.0, 1: 1.0, 2: 1.0}, validation_data=None)
    assert _max_difference(some.model.get_weights(), every.model.get_weights()) == 0.0
    unweighted = _fit(_penalised, validation_data=None)
    assert _max_difference(some.model.get_weights(), unweighted.model.get_weights()) > 1e-4


class EndpointLoss(keras.layers.Layer):
    """keras-io's endpoint layer pattern: a Keras loss object on the targets the model takes as an input, add_loss."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def call(self, targets, logits):
        self.add_loss(self.loss_fn(targets, logits))
        return logits


def _endpoint():
    keras.utils.set_random_seed(3)
    x, targets = keras.Input((6,)), keras.Input((), dtype="int32")
    logits = keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(x))
    model = keras.Model([x, targets], EndpointLoss()(targets, logits))
    model.compile(optimizer=keras.optimizers.SGD(0.2))
    return model


def test_a_keras_loss_added_in_the_model_is_divided_once_on_several_replicas():
    """Keras' fit divides it by the replica count twice (the loss object and its add_loss); gpupar once."""
    x, y = _data()
    one, two = (gpupar.fit(_endpoint, [x, y], batch_size=32, epochs=2, shuffle=False, verbose=0, save=False, **options)
                for options in (dict(strategy="one_device"), dict(strategy="mirrored", virtual_cpus=2)))
    assert _max_difference(one.model.get_weights(), two.model.get_weights()) < 1e-5
    assert two.history["loss"] == pytest.approx(one.history["loss"], rel=1e-5)
