"""gpupar.fit means what model.fit means: Keras' own loss, masks, metrics, callbacks and build, on 1 and 2 replicas.

Each test holds gpupar.fit to Keras' own numbers on one device (model.fit, or model.evaluate of
the same weights), under SGD, where a wrong scale or a wrong denominator shows in the weights.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import gpupar
from conftest import two_replicas

ATOL = 1e-5


def _replicas(replicas):
    """gpupar's options for one device or two replicas on this process's virtual CPUs."""
    return dict(strategy="one_device") if replicas == 1 else dict(strategy="mirrored", virtual_cpus=replicas)


def _largest_difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a.get_weights(), b.get_weights()))


def _twins(build):
    """Two models with the same initial weights: one for Keras' fit, one for gpupar's."""
    keras.utils.set_random_seed(7)
    first = build()
    keras.utils.set_random_seed(7)
    return first, build()


def _dense_without_input():
    model = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


def _regression(num=96):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num, 5)).astype("float32")
    return x, (x[:, :1] * 2 - x[:, 1:2]).astype("float32")


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_model_without_an_input_trains_as_model_fit_trains_it(replicas):
    x, y = _regression()
    keras_model, model = _twins(_dense_without_input)
    expected = keras_model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    result = gpupar.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, save=False,
                        **_replicas(replicas))
    assert result.model is model and int(model.optimizer.iterations.numpy()) == 12
    assert _largest_difference(model, keras_model) < ATOL
    assert result.history["loss"] == pytest.approx(expected.history["loss"], rel=1e-5)
    assert result.history["loss"][1] < result.history["loss"][0]  # control: it trained


def test_a_model_without_an_input_fits_again_and_goes_on():
    x, y = _regression()
    keras_model, model = _twins(_dense_without_input)
    for _ in range(2):
        keras_model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        gpupar.fit(model, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, save=False)
    assert int(model.optimizer.iterations.numpy()) == 12 and _largest_difference(model, keras_model) < ATOL


def _tagged(num=64, steps=7, vocabulary=20, classes=5, seed=0):
    """Padded token ids (0 is padding, each sequence a random length) and per-token classes."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, vocabulary, size=(num, steps))
    for row, length in enumerate(rng.integers(1, steps + 1, size=num)):
        x[row, length:] = 0
    return x.astype("int32"), rng.integers(0, classes, size=(num, steps)).astype("int32")


def _tagger(mask_zero, loss):
    def build():
        inputs = keras.Input((7,), dtype="int32")
        hidden = keras.layers.Embedding(20, 8, mask_zero=mask_zero)(inputs)
        hidden = keras.layers.LSTM(8, return_sequences=True)(hidden)
        model = keras.Model(inputs, keras.layers.Dense(5)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss, metrics=["accuracy"])
        return model
    return build


MASKED = {
    "output mask (Embedding mask_zero)": _tagger(True, keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
    "ignore_class": _tagger(False, keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)),
}


@pytest.mark.parametrize("name", sorted(MASKED))
def test_masked_losses_average_over_real_tokens_as_keras_on_two_replicas(name):
    x, y = _tagged()
    if name == "ignore_class":
        y = np.where(x == 0, 0, y)  # the padding's label is the ignored class
    x_val, y_val = _tagged(seed=1)
    y_val = np.where(x_val == 0, 0, y_val) if name == "ignore_class" else y_val
    keras_model, model = _twins(MASKED[name])
    expected = keras_model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    result = gpupar.fit(model, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, save=False,
                        validation_data=(x_val, y_val), **_replicas(2))
    assert _largest_difference(model, keras_model) < ATOL  # the same updates: the same denominators
    assert result.history["loss"] == pytest.approx(expected.history["loss"], rel=1e-5)
    evaluated = MASKED[name]()
    evaluated.set_weights(model.get_weights())
    loss, accuracy = evaluated.evaluate(x_val, y_val, batch_size=32, verbose=0)
    assert result.history["val_loss"][-1] == pytest.approx(loss, rel=1e-5)
    assert result.history["val_accuracy"][-1] == pytest.approx(accuracy, abs=1e-6)
    # Control: counting the padding trains other weights, far from these.
    keras.utils.set_random_seed(7)
    counted = _tagger(False, keras.losses.SparseCategoricalCrossentropy(from_logits=True))()
    counted.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert _largest_difference(counted, keras_model) > 1e-3


class _Recorder(keras.callbacks.Callback):
    """Records every hook Keras' fit calls, in order, with its step or epoch."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __getattribute__(self, name):
        if name.startswith("on_") and not name.startswith("on_predict"):
            calls = object.__getattribute__(self, "calls")
            return lambda *args, **kwargs: calls.append((name, *(a for a in args if isinstance(a, int))))
        return object.__getattribute__(self, name)


def test_every_callback_hook_is_called_where_model_fit_calls_it():
    x, y = _regression(64)
    keras_model, model = _twins(_dense_without_input)
    expected, recorded = _Recorder(), _Recorder()
    keras_model.fit(x, y, batch_size=16, epochs=2, validation_data=(x[:32], y[:32]), callbacks=[expected], verbose=0)
    gpupar.fit(model, x, y, batch_size=16, epochs=2, validation_data=(x[:32], y[:32]), callbacks=[recorded],
               verbose=0, save=False, steps_per_call=1)
    assert ("on_test_batch_end", 1) in expected.calls and ("on_train_batch_begin", 3) in expected.calls
    assert recorded.calls == expected.calls


def test_use_ema_leaves_the_averaged_weights_as_model_fit_does():
    def build():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5), loss="mse")
        return model

    x, y = _regression()
    keras_model, model = _twins(build)
    keras_model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    gpupar.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, save=False)
    assert _largest_difference(model, keras_model) < ATOL
    # Control: without the averages the weights end elsewhere.
    plain_keras, plain = _twins(lambda: _plain(build))
    plain_keras.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert _largest_difference(plain_keras, keras_model) > 1e-3


def _plain(build):
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_early_stopping_on_a_compiled_metric_reads_its_direction_in_auto_mode():
    x, y = _regression()
    stop = keras.callbacks.EarlyStopping(monitor="mae", patience=0, mode="auto")
    result = gpupar.fit(_dense_without_input(), x, y, batch_size=16, epochs=3, verbose=0, save=False,
                        callbacks=[stop])
    assert stop.monitor_op is not None and len(result.history["mae"]) >= 1


class CategoricalTruePositives(keras.metrics.Metric):
    """A user's metric written as Keras' guide to its built-in methods writes its custom metric (the guide's name).

    Its state is one counter that each update adds to. As in the guide, the predicted classes
    are a column (N, 1) compared with labels of shape (N,): the comparison broadcasts to (N, N),
    so the count is not additive over the halves of a batch; Keras trains it all the same.
    """

    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        predicted = keras.ops.expand_dims(keras.ops.argmax(y_pred, axis=1), -1)
        hits = keras.ops.cast(keras.ops.cast(y_true, "int32") == keras.ops.cast(predicted, "int32"), "float32")
        if sample_weight is not None:
            hits = hits * keras.ops.cast(sample_weight, "float32")
        self.count.assign_add(keras.ops.sum(hits))

    def result(self):
        return self.count


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_users_own_metric_trains_every_time_with_keras_numbers(replicas):
    """Ten data sets, each trained with Keras' fit and gpupar's on as many replicas: the same metric every time."""
    def build():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=[CategoricalTruePositives()])
        return model

    strategy = two_replicas() if replicas == 2 else tf.distribute.get_strategy()
    for seed in range(10):
        rng = np.random.default_rng(seed)
        x, y = rng.normal(size=(64, 5)).astype("float32"), rng.integers(0, 3, size=(64,))
        keras_model, model = _twins(build)
        with strategy.scope():  # Keras' own fit on as many replicas: its model made in the strategy's scope
            keras.utils.set_random_seed(7)
            keras_model = build()
        expected = keras_model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
        result = gpupar.fit(model, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, save=False,
                            **_replicas(replicas))
        assert result.history["categorical_true_positives"] == pytest.approx(
            expected["categorical_true_positives"]), seed
        assert _largest_difference(model, keras_model) < ATOL


class _NoArguments(keras.layers.Layer):
    """A custom layer whose __init__ takes no arguments (Keras makes its config itself)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x) * 2.0


@keras.saving.register_keras_serializable(package="test_keras_semantics")
class _Scaled(keras.layers.Layer):
    """A custom layer with its own get_config."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x) * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


def _squared_error(y_true, y_pred):  # a plain function as the loss
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def _built(kind):
    if kind == "sequential":
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    elif kind == "functional":
        inputs = keras.Input((5,))
        model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    elif kind == "custom layer, no arguments":
        model = keras.Sequential([keras.Input((5,)), _NoArguments()])
    elif kind == "custom layer with get_config":
        model = keras.Sequential([keras.Input((5,)), _Scaled(0.5)])
    else:
        model = Subclassed()
        model(np.zeros((1, 5), "float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_squared_error if kind == "functional" else "mse",
                  metrics=["mae"])
    return model


@pytest.mark.parametrize("kind", ["sequential", "functional", "custom layer, no arguments",
                                  "custom layer with get_config", "subclassed, no arguments"])
def test_a_model_built_outside_any_strategy_trains_on_two_replicas_as_on_one_device(kind):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(64, 5)).astype("float32"), rng.normal(size=(64, 3)).astype("float32")
    keras_model, model = _twins(lambda: _built(kind))
    keras_model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    result = gpupar.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, save=False, **_replicas(2))
    assert result.model is model and result.replicas == 2
    assert _largest_difference(model, keras_model) < ATOL
    again = gpupar.fit(model, x, y, batch_size=16, epochs=1, verbose=0, save=False, **_replicas(2))
    assert again.replicas == 2 and int(model.optimizer.iterations.numpy()) == 12  # the same optimizer goes on
    assert model.predict(x[:1], verbose=0).shape == (1, 3)  # Keras' own predict works on it after


def test_a_zip_of_batched_datasets_is_batched_as_keras_takes_it():
    """keras-io's SimCLR fits on Dataset.zip((unlabeled, labeled)), both batched; its train_step unpacks the pair."""

    class Contrastive(keras.Model):
        def __init__(self):
            super().__init__()
            self.encoder = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])  # as SimCLR's encoders

        def train_step(self, data):
            (unlabeled, _), (images, labels) = data
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(self.encoder(unlabeled))) + keras.ops.mean(
                    keras.ops.square(self.encoder(images) - labels))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss, "rows": keras.ops.shape(images)[0]}

    rng = np.random.default_rng(0)
    unlabeled = tf.data.Dataset.from_tensor_slices((rng.normal(size=(64, 6)).astype("float32"),
                                                    np.zeros(64, "int32"))).batch(16)
    labeled = tf.data.Dataset.from_tensor_slices((rng.normal(size=(32, 6)).astype("float32"),
                                                  rng.normal(size=(32, 4)).astype("float32"))).batch(8)
    model = Contrastive()
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    result = gpupar.fit(model, tf.data.Dataset.zip((unlabeled, labeled)), epochs=1, verbose=0, save=False)
    assert result.records[0].steps == 4 and result.history["rows"] == [8.0]


class Trainer(keras.Model):
    """The Trainer pattern of keras-io's recipes: one model class whose own train_step and test_step train another.

    Written after keras-io's examples/keras_recipes/trainer_pattern.py (Keras 3 version): the
    trainer holds the model, its own Keras loss object and metric, and lists the metric itself.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.accuracy = keras.metrics.SparseCategoricalAccuracy()

    @property
    def metrics(self):
        return [self.accuracy]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.loss_fn(y, self.model(x, training=True))
        variables = self.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        self.accuracy.update_state(y, self.model(x, training=False))
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        self.accuracy.update_state(y, self.model(x, training=False))
        return {m.name: m.result() for m in self.metrics}

    def call(self, x):
        return self.model(x)


def _trainers():
    """Two Trainers, as the recipe has them: of a Sequential model, and of a functional one."""
    sequential = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    inputs = keras.Input((6,))
    functional = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(4, activation="relu")(inputs)))
    trainers = [Trainer(sequential), Trainer(functional)]
    for trainer in trainers:
        trainer.compile(optimizer=keras.optimizers.SGD(0.1))
    return trainers


def test_the_trainer_pattern_ports_by_two_renames_and_updates_as_keras_on_one_device():
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(128, 6)).astype("float32"), rng.integers(0, 3, size=(128,))
    keras.utils.set_random_seed(3)
    expected = _trainers()
    for trainer in expected:
        trainer.fit(x, y, batch_size=32, epochs=2, shuffle=False, validation_data=(x[:64], y[:64]), verbose=0)
    strategy = gpupar.strategy("mirrored", virtual_cpus=2)  # was: tf.distribute.MirroredStrategy()
    keras.utils.set_random_seed(3)
    with strategy.scope():
        trainers = _trainers()
    for trainer, keras_trainer in zip(trainers, expected):
        result = gpupar.fit(trainer, x, y, batch_size=32, epochs=2, shuffle=False,  # was: trainer.fit(x, y, ...)
                            validation_data=(x[:64], y[:64]), verbose=0, save=False)
        assert result.replicas == 2 and int(trainer.optimizer.iterations.numpy()) == 8
        assert _largest_difference(trainer, keras_trainer) < ATOL  # a Keras loss object's mean, as on one device
        assert set(result.history) == {"sparse_categorical_accuracy", "val_sparse_categorical_accuracy"}


def test_a_generator_as_validation_data_with_validation_steps_reads_it_as_keras():
    """Each evaluation reads validation_steps batches as Keras' generator adapter gives them: the two it read first
    (for the spec) again each time, then the next ones of the stream. Here the labels are 0 in batches 0 and 1, and
    the batch's number after; the model predicts 0."""
    def labels_by_batch():
        for number in range(100):
            yield np.ones((8, 2), "float32"), np.full((8, 1), float(number if number >= 2 else 0), "float32")

    def frozen():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="zeros")])
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # predicts 0 for ever
        return model

    x, y = np.ones((16, 2), "float32"), np.zeros((16, 1), "float32")
    expected = frozen().fit(x, y, batch_size=8, epochs=2, validation_data=labels_by_batch(), validation_steps=3,
                            verbose=0).history["val_loss"]
    result = gpupar.fit(frozen(), x, y, batch_size=8, epochs=2, validation_data=labels_by_batch(), validation_steps=3,
                        verbose=0, save=False)
    # Keras' first evaluation reads batches 0, 1 and 2; its later ones depend on how far its prefetching read
    # the stream ahead (batch 3, 5 or 7 in runs here); gpupar's read each next one: batch 3.
    assert expected[0] == pytest.approx(4 / 3) and result.history["val_loss"] == pytest.approx([4 / 3, 9 / 3])
    with pytest.raises(gpupar.GpuparError, match="give validation_steps"):
        gpupar.fit(frozen(), x, y, batch_size=8, validation_data=labels_by_batch(), verbose=0, save=False)
