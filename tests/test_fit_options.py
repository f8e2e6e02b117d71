"""gpupar.fit's options on the user's own model (not the MNIST preset): diagnose, tuple inputs and outputs,
mixed_bfloat16, nan_policy=skip, jit_compile, strategy=parameter_server without a cluster, label checks."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import gpupar
from gpupar.errors import GpuparError
from test_fit import ATOL, _data, _dense, _difference, _fit, _moved

LOGITS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _weights_apart(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


# --- 1. gpupar.diagnose on a user model ---------------------------------------------------------------------------


class _CountingSteps(keras.layers.Layer):
    """Passes its input through and counts the forward passes made in training (the steps it is in)."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

    def call(self, x, training=False):
        if training:
            self.calls.assign_add(1.0)
        return x


@pytest.mark.parametrize("replicas", [1, 2])
def test_diagnose_times_the_users_model_on_the_users_data(replicas, float32_only):
    from gpupar.commands.diagnose import ROUNDS, VIRTUAL_CPU_NOTE, WARM_UP_STEPS, verdict

    built = []

    def model_fn():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), _CountingSteps(),
                                  keras.layers.Dense(4)])
        built.append(model)
        return model

    options = dict(strategy="one_device") if replicas == 1 else dict(strategy="mirrored", virtual_cpus=2)
    report = gpupar.diagnose(model_fn, *_data(), loss=LOGITS, optimizer=keras.optimizers.SGD(0.1),
                             batch_size=32, steps=4, **options)
    assert len(built) == 1 and report.global_batch == 32 and report.steps == 4
    rates = (report.input_examples_per_second, report.step_examples_per_second, report.together_examples_per_second)
    assert all(np.isfinite(rate) and rate > 0 for rate in rates)
    assert (report.input_bound, report.bound_by) == verdict(*rates)
    assert (VIRTUAL_CPU_NOTE in report.notes) == (replicas == 2)
    # The user's model ran every timed and warm-up step: the step alone and the step with the pipeline.
    counter = built[0].layers[1].calls
    assert float(keras.ops.convert_to_numpy(counter)) == 2 * (WARM_UP_STEPS + ROUNDS * 4)
    assert not os.path.exists("runs")  # diagnose writes nothing


def test_diagnose_refuses_bad_input_like_fit():
    with pytest.raises(GpuparError, match="dataset is an option of the MNIST presets"):
        gpupar.diagnose(_dense(), *_data(), dataset="mnist")
    x, y = _data()
    with pytest.raises(GpuparError, match=r"the arrays have different numbers of examples \(x 256, y 255\)"):
        gpupar.diagnose(_dense(), x, y[:-1], loss=LOGITS, strategy="one_device", batch_size=32, steps=4)


# --- 2. tuple multi-input and multi-output models ------------------------------------------------------------------


def _two_in_two_out():
    keras.utils.set_random_seed(3)
    wide, narrow = keras.Input((4,), name="wide"), keras.Input((2,), name="narrow")
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([wide, narrow]))
    return keras.Model((wide, narrow), [keras.layers.Dense(4, name="kind")(hidden),
                                        keras.layers.Dense(1, name="size")(hidden)])


def _tuple_data(num=256, seed=0):
    x, y = _data(num, seed)
    return (x[:, :4], x[:, 4:]), (y, (x[:, :1] * 2 - x[:, 5:6]).astype("float32"))


TUPLE_LOSS = [LOGITS, "mse"]


def test_a_tuple_multi_input_multi_output_model_gives_the_weights_of_one_device():
    data = _tuple_data()
    one = _fit(_two_in_two_out, data, 1, loss=TUPLE_LOSS, metrics=None)
    two = _fit(_two_in_two_out, data, 2, loss=TUPLE_LOSS, metrics=None)
    assert one.replicas == 1 and two.replicas == 2
    assert _moved(one, _two_in_two_out) > 100 * ATOL
    # Each output's loss trains its own head: both heads moved.
    fresh = _two_in_two_out()
    for head in ("kind", "size"):
        assert _weights_apart(one.model.get_layer(head).get_weights(), fresh.get_layer(head).get_weights()) > 100 * ATOL
    assert _difference(one, two) < ATOL
    assert one.records[0].train_loss == pytest.approx(two.records[0].train_loss, abs=1e-5)


def test_a_tuple_model_on_two_replicas_trains_as_keras_model_fit():
    """The whole set is one global batch, so the order of examples plays no part: gpupar's three SGD steps on two
    replicas and model.fit's on one device must agree, which checks which input, label and loss go with which output."""
    x, y = _tuple_data(32, seed=4)
    gpu = _fit(_two_in_two_out, (x, y), 2, loss=TUPLE_LOSS, metrics=None, epochs=3, steps_per_epoch=None)
    reference = _two_in_two_out()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=TUPLE_LOSS)
    reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert len(gpu.records) == 3 and gpu.records[0].steps == 1
    assert _weights_apart(reference.get_weights(), _two_in_two_out().get_weights()) > 100 * ATOL
    assert _weights_apart(gpu.model.get_weights(), reference.get_weights()) < ATOL
    # Control: another loss on the second output (mae for mse) ends elsewhere, so the comparison sees every output.
    swapped = _two_in_two_out()
    swapped.compile(optimizer=keras.optimizers.SGD(0.1), loss=[LOGITS, "mae"])
    swapped.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert _weights_apart(gpu.model.get_weights(), swapped.get_weights()) > 100 * ATOL


def test_a_tuple_model_takes_one_metric_list_per_output_and_logs_keras_names():
    """fit's docstring: metrics are 'a dict or list of lists per output'; model.fit logs them by output name."""
    data = _tuple_data()
    result = _fit(_two_in_two_out, data, 2, validation_data=_tuple_data(64, seed=5), loss=TUPLE_LOSS,
                  metrics=[["accuracy"], ["mae"]])
    assert set(result.logs) == {"loss", "kind_loss", "size_loss", "kind_accuracy", "size_mae",  # Keras' names
                                "val_loss", "val_kind_loss", "val_size_loss", "val_kind_accuracy", "val_size_mae"}
    assert np.isfinite(list(result.logs.values())).all()


# --- 3. precision, nan_policy and jit_compile on a user model ------------------------------------------------------


def _update(result, model_fn):
    return np.concatenate([(a - b).ravel() for a, b in zip(result.model.get_weights(), model_fn().get_weights())])


def test_mixed_bfloat16_computes_the_users_layers_in_16_bits_and_keeps_the_update():
    plain = _fit(_dense(), _data(), 2, loss=LOGITS)
    mixed = _fit(_dense(), _data(), 2, loss=LOGITS, precision="mixed_bfloat16")
    dense = mixed.model.layers[0]
    assert dense.compute_dtype == "bfloat16" and dense.kernel.dtype == "float32"  # float32 master weights
    assert keras.config.dtype_policy().name == "float32"  # the user's policy is put back after the run
    # bfloat16 keeps 8 bits of mantissa: not the float32 numbers, but the same update to that rounding.
    first, second = _update(plain, _dense()), _update(mixed, _dense())
    assert _difference(plain, mixed) > ATOL
    assert float(first @ second / np.linalg.norm(first) / np.linalg.norm(second)) > 0.95
    assert mixed.records[0].train_loss == pytest.approx(plain.records[0].train_loss, rel=3e-2)


def _with_batch_norm():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
                             keras.layers.Activation("tanh"), keras.layers.Dense(4)])


def test_nan_policy_skip_skips_the_step_on_every_replica_and_trains_as_if_it_was_not_there():
    x, y = _data()
    poisoned = x.copy()
    # The 4th global batch of 32 (a dataset keeps its order), in replica 1's half only: Keras' loss-scale optimizer
    # decides from replica 0's gradients alone, so gpupar must tell it about the other replicas'.
    poisoned[120, 2] = np.nan
    kept = np.r_[0:96, 128:256]

    def run(features, labels, **options):
        return _fit(_with_batch_norm, tf.data.Dataset.from_tensor_slices((features, labels)), 2, loss=LOGITS,
                    steps_per_epoch=None, **options)

    skipped = run(poisoned, y, nan_policy="skip")
    assert skipped.records[0].skipped_steps == 1 and np.isfinite(skipped.records[0].train_loss)
    assert all(np.isfinite(w).all() for w in skipped.model.get_weights())  # batch-norm statistics included
    # Skipped on both replicas: every variable's two copies are still the same.
    for variable in skipped.model.weights:
        copies = [np.asarray(c) for c in skipped.strategy.experimental_local_results(variable.value)]
        assert len(copies) == 2 and np.array_equal(copies[0], copies[1]), variable.path
    # The skipped step changed nothing: the weights are those of the 7 other batches, in the same order.
    without = run(x[kept], y[kept])
    assert without.records[0].steps == 7
    assert _difference(skipped, without) < ATOL
    # Control: the batch, not poisoned, moves the weights elsewhere.
    assert _difference(skipped, run(x, y)) > 100 * ATOL
    # Control: without nan_policy=skip the same data stop the run.
    with pytest.raises(GpuparError, match="training loss became nan"):
        run(poisoned, y)


def test_jit_compile_trains_the_users_model_in_xla_to_the_same_weights():
    # 100 examples in batches of 32: three full batches through XLA, then one of 4 (compiled_for_full_batches).
    plain = _fit(_dense(), _data(100), 1, loss=LOGITS, steps_per_epoch=None)
    compiled = _fit(_dense(), _data(100), 1, loss=LOGITS, steps_per_epoch=None, jit_compile=True)
    assert [r.steps for r in compiled.records] == [4]
    assert _moved(plain, _dense()) > 100 * ATOL and _difference(plain, compiled) < ATOL

    # The step really goes through XLA: an op XLA cannot compile trains without jit_compile, and not with it.
    class OnTheHost(keras.layers.Layer):
        def call(self, x):
            return x + tf.reshape(tf.numpy_function(np.zeros_like, [x], tf.float32), tf.shape(x))

    def host_model():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((6,)), OnTheHost(), keras.layers.Dense(4)])

    assert _moved(_fit(host_model, _data(), 1, loss=LOGITS, steps_per_epoch=1), host_model) > 0
    with pytest.raises(Exception, match=r"(?s)XLA.*PyFunc"):  # "unsupported operations ... on XLA_CPU_JIT: PyFunc"
        _fit(host_model, _data(), 1, loss=LOGITS, steps_per_epoch=1, jit_compile=True)


def test_jit_compile_with_two_cpu_replicas_trains_a_user_model_as_without_it():
    compiled = _fit(_dense(), _data(), 2, loss=LOGITS, jit_compile=True)
    assert _difference(_fit(_dense(), _data(), 2, loss=LOGITS), compiled) < ATOL


# --- 4. strategy=parameter_server on a user model without a cluster ------------------------------------------------


def test_parameter_server_for_a_user_model_without_a_cluster_is_one_line_before_any_work():
    trained = []

    def model_fn():
        trained.append(True)
        return _dense()()

    with pytest.raises(GpuparError) as e:
        gpupar.fit(model_fn, *_data(), loss=LOGITS, strategy="parameter_server", batch_size=16, epochs=1, save=True)
    message = str(e.value)
    assert "strategy=parameter_server" in message and "\n" not in message
    assert not trained and not os.path.exists("runs")  # no model built, nothing written


# --- 5. labels outside the model's outputs, with loss objects ------------------------------------------------------


@pytest.mark.parametrize("name, loss, model_fn, data", [
    ("a Keras loss object", LOGITS, _dense(), None),
    ("a Keras loss object named by the user", keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                                          name="xent"), _dense(), None),
    ("a tuple model's list of loss objects", TUPLE_LOSS, _two_in_two_out, "tuple"),
])
def test_labels_outside_the_outputs_are_refused_with_a_loss_object(name, loss, model_fn, data):
    if data == "tuple":
        x, (y, size) = _tuple_data()
        y = y.copy()
        y[200] = 7  # past the first examples, which the checks run the model on
        data = (x, (y, size))
    else:
        x, y = _data()
        y = y.copy()
        y[200] = 7
        data = (x, y)
    with pytest.raises(GpuparError) as e:
        gpupar.fit(model_fn, *data, loss=loss, strategy="one_device", batch_size=32, epochs=1, save=True)
    assert "the labels reach 0..7, but the model has 4 outputs" in str(e.value), name
    assert "\n" not in str(e.value) and not os.path.exists("runs"), name
