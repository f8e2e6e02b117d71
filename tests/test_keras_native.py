"""gpupar.fit as model.fit: its arguments, a compiled model, Keras' loss names and metrics, every input form, History."""

import inspect
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import gpupar
from gpupar.errors import GpuparError

ATOL = 1e-5  # SGD: a wrong batch or scale shows far above float32 reordering


def _data(num=256, seed=0, classes=4):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num, 6)).astype("float32")
    return x, np.argmax(x[:, :classes], axis=1).astype("int32")


def _compiled(softmax=False, metrics=("accuracy",), **compile_options):
    def model_fn():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(4, activation="softmax" if softmax else None)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=not softmax),
                      metrics=list(metrics), **compile_options)
        return model

    return model_fn


def _keras_fit(model_fn, *args, **kwargs):
    """Keras' own model.fit on one device."""
    model = model_fn()
    history = model.fit(*args, verbose=0, **kwargs)
    return model, history


def _apart(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a.get_weights(), b.get_weights()))


# --- model.fit's arguments, with Keras' meaning ---------------------------------------------------------------------


@pytest.mark.parametrize("num", [256, 250])  # 250: a last partial batch each epoch, as Keras trains it
def test_two_replicas_with_batch_size_64_give_the_weights_of_model_fit_on_one_device(num):
    x, y = _data(num)
    keras_model, history = _keras_fit(_compiled(), x, y, batch_size=64, epochs=2, shuffle=False)
    ours = gpupar.fit(_compiled(), x, y, batch_size=64, epochs=2, shuffle=False, strategy="mirrored", virtual_cpus=2,
                      save=False)
    assert ours.global_batch == 64 and ours.replicas == 2
    assert _apart(keras_model, _compiled()()) > 100 * ATOL  # the epochs moved the weights
    assert _apart(ours.model, keras_model) < ATOL
    assert ours.history["loss"] == pytest.approx(history.history["loss"], abs=1e-4)
    assert ours.history["accuracy"] == pytest.approx(history.history["accuracy"], abs=1e-6)
    # Control: a batch of 64 per replica is another batch (128), and other weights.
    per_replica = gpupar.fit(_compiled(), x, y, per_replica_batch_size=64, epochs=2, shuffle=False,
                             strategy="mirrored", virtual_cpus=2, save=False)
    assert per_replica.global_batch == 128 and _apart(per_replica.model, keras_model) > 100 * ATOL


def test_the_batch_line_says_the_global_batch_and_each_replicas_share(caplog):
    caplog.set_level("INFO", "gpupar")
    gpupar.fit(_compiled(), *_data(), batch_size=64, strategy="mirrored", virtual_cpus=2, save=False)
    assert "batch: 64 examples per step, 32 per replica on 2 replicas" in caplog.text


def test_validation_split_class_weight_initial_epoch_and_validation_freq_mean_what_they_mean_in_keras():
    x, y = _data(300)
    weights = {0: 2.0, 1: 0.5, 2: 1.0, 3: 1.5}
    settings = dict(batch_size=32, epochs=4, validation_split=0.2, class_weight=weights, initial_epoch=1,
                    validation_freq=2, shuffle=False)
    keras_model, history = _keras_fit(_compiled(), x, y, **settings)
    ours = gpupar.fit(_compiled(), x, y, strategy="mirrored", virtual_cpus=2, save=False, **settings)
    assert ours.epoch == history.epoch == [1, 2, 3]
    assert _apart(ours.model, keras_model) < ATOL
    assert [r.steps for r in ours.records] == [8, 8, 8]  # 240 of 300 examples train: the last 60 validate
    # Evaluated after epochs 2 and 4 (validation_freq=2): Keras' history has val_loss then only.
    assert [("val_loss" in r.logs) for r in ours.records] == [True, False, True]
    assert ours.history["val_loss"] == pytest.approx(history.history["val_loss"], abs=1e-5)


def test_sample_weights_reach_the_weighted_metrics_only_as_in_keras():
    x, y = _data()
    weights = np.where(y == 0, 5.0, 0.2).astype("float32")
    model_fn = _compiled(metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
                         weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")])
    _, history = _keras_fit(model_fn, x, y, sample_weight=weights, batch_size=32, shuffle=False)
    ours = gpupar.fit(model_fn, x, y, sample_weight=weights, batch_size=32, shuffle=False, save=False)
    assert set(ours.history) == set(history.history) == {"loss", "acc", "weighted_acc"}
    for name in history.history:
        assert ours.history[name] == pytest.approx(history.history[name], abs=1e-5), name
    assert ours.history["acc"] != pytest.approx(ours.history["weighted_acc"], abs=1e-3)  # the weights do count


def test_keras_stateful_metrics_on_two_replicas_give_one_devices_values():
    x, y = _data()
    labels = (y == 0).astype("float32")

    def model_fn():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[keras.metrics.AUC(from_logits=True, name="auc"),
                               keras.metrics.Precision(thresholds=[0.3, 0.7], name="precision"),
                               keras.metrics.Recall(thresholds=0.6, name="recall"),
                               keras.metrics.F1Score(threshold=0.5, name="f1_score"),
                               keras.metrics.MeanIoU(num_classes=2, sparse_y_pred=False, name="mean_io_u")])
        return model

    y_one_hot = labels[:, None]
    settings = dict(batch_size=32, epochs=1, shuffle=False, validation_data=(x[:100], y_one_hot[:100]), save=False)
    one = gpupar.fit(model_fn, x, y_one_hot, strategy="one_device", **settings)
    two = gpupar.fit(model_fn, x, y_one_hot, strategy="mirrored", virtual_cpus=2, **settings)
    assert set(one.logs) == set(two.logs) and len(one.logs) == 12
    for name, value in one.logs.items():
        assert np.allclose(two.logs[name], value, atol=1e-5), name
    # The evaluation's numbers are Keras' own evaluate's over the whole set, 2 replicas' as 1 device's.
    evaluated = two.model.evaluate(x[:100], y_one_hot[:100], verbose=0, return_dict=True)
    for name in ("auc", "precision", "recall", "f1_score", "mean_io_u"):
        assert np.allclose(two.logs[f"val_{name}"], evaluated[name], atol=1e-5), name


# --- a compiled model, and the result ------------------------------------------------------------------------------


def test_a_compiled_models_loss_weights_metrics_and_optimizer_are_used():
    def model_fn():
        keras.utils.set_random_seed(2)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        model = keras.Model(inputs, {"kind": keras.layers.Dense(4, name="kind")(hidden),
                                     "size": keras.layers.Dense(1, name="size")(hidden)})
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss={"kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "size": "mse"},
                      loss_weights={"kind": 1.0, "size": 0.25}, metrics={"kind": ["accuracy"], "size": ["mae"]})
        return model

    x, y = _data()
    targets = {"kind": y, "size": x[:, :1] * 2}
    keras_model, history = _keras_fit(model_fn, x, targets, batch_size=32, epochs=2, shuffle=False)
    ours = gpupar.fit(model_fn, x, targets, batch_size=32, epochs=2, shuffle=False, strategy="mirrored",
                      virtual_cpus=2, save=False)
    assert _apart(ours.model, keras_model) < ATOL
    assert set(ours.history) == set(history.history)
    assert ours.history["loss"] == pytest.approx(history.history["loss"], abs=1e-4)


def test_the_result_works_as_keras_history_and_its_model_as_after_model_fit(tmp_path):
    x, y = _data()
    result = gpupar.fit(_compiled(), x, y, batch_size=32, epochs=2, validation_data=_data(64, 5),
                        strategy="mirrored", virtual_cpus=2, save=False)
    assert result.epoch == [0, 1] and len(result.history["val_loss"]) == 2
    assert result.model.history.history["loss"] == pytest.approx(result.history["loss"])  # Keras' History too
    loss, accuracy = result.model.evaluate(*_data(64, 5), verbose=0)  # no scope entered
    assert loss == pytest.approx(result.history["val_loss"][-1], rel=1e-4)
    assert result.model.predict(x[:4], verbose=0).shape == (4, 4)
    result.model.save(tmp_path / "m.keras")
    assert keras.models.load_model(tmp_path / "m.keras").predict(x[:4], verbose=0).shape == (4, 4)


def test_an_uncompiled_model_comes_back_compiled_with_fits_loss_and_metrics():
    x, y = _data()

    def model_fn():
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])

    result = gpupar.fit(model_fn, x, y, batch_size=32, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        metrics=["accuracy"], save=False)
    assert len(result.model.evaluate(x, y, verbose=0)) == 2


def test_gpupar_fit_takes_model_fits_arguments_in_its_order():
    keras_names = list(inspect.signature(keras.Model.fit).parameters)[1:]
    ours = list(inspect.signature(gpupar.fit).parameters)[1:len(keras_names) + 1]
    assert ours == keras_names


# --- losses by name -------------------------------------------------------------------------------------------------


def _loss_names():
    skip = {"get", "serialize", "deserialize", "ctc", "circle", "reduce_weighted_values"}
    return sorted(name for name in dir(keras.losses) if name[0].islower() and name not in skip
                  and inspect.isfunction(getattr(keras.losses, name)))


@pytest.mark.parametrize("name", _loss_names())
@pytest.mark.parametrize("label_shape", ["(N,)", "(N, 1)"])
def test_every_keras_loss_name_gives_keras_value_on_the_same_batch(name, label_shape):
    from gpupar.training.loss import global_batch_losses, replica_loss

    rng = np.random.default_rng(3)
    y_pred = rng.uniform(0.05, 0.95, size=(16, 1)).astype("float32")
    y_true = rng.integers(0, 2, size=(16,)).astype("float32")
    if label_shape == "(N, 1)":
        y_true = y_true[:, None]
    model = keras.Sequential([keras.Input((1,)), keras.layers.Identity()])
    model.compile(loss=name)
    try:
        expected = float(model.compute_loss(y=y_true, y_pred=y_pred))
    except Exception:  # Keras itself takes no such labels for this loss: nothing to compare
        return
    with global_batch_losses(model):  # Keras' CompileLoss, built by compute_loss, each loss reduced by gpupar
        ours = float(replica_loss(model, tf.constant(y_true), tf.constant(y_pred), None)[1])
    assert ours == pytest.approx(expected, rel=1e-5, abs=1e-6, nan_ok=True), name


def test_the_loss_name_test_covers_the_losses_the_issue_names():
    assert {"binary_crossentropy", "hinge", "squared_hinge", "poisson"} <= set(_loss_names())


# --- input forms ----------------------------------------------------------------------------------------------------


class _Batches(keras.utils.PyDataset):
    """Batches of 32 by index; raises at `broken`."""

    def __init__(self, x, y, broken=None, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.broken = x, y, broken

    def __len__(self):
        return len(self.x) // 32

    def __getitem__(self, index):
        if index == self.broken:
            raise OSError(f"image {index} is unreadable")
        return self.x[index * 32:(index + 1) * 32], self.y[index * 32:(index + 1) * 32]


def test_a_pydataset_with_workers_trains_and_resumes_mid_epoch_exactly(tmp_path):
    x, y = _data()
    settings = dict(epochs=2, strategy="mirrored", virtual_cpus=2)
    straight = gpupar.fit(_compiled(), _Batches(x, y, workers=2), save=False, **settings)
    assert straight.global_batch == 32 and [r.steps for r in straight.records] == [8, 8]
    model_dir = str(tmp_path / "run")
    gpupar.fit(_compiled(), _Batches(x, y, workers=2), model_dir=model_dir, checkpoint_every_steps=3,
               **{**settings, "epochs": 1})
    resumed = gpupar.fit(_compiled(), _Batches(x, y, workers=2), model_dir=model_dir,
                         resume=os.path.join(model_dir, "within_epoch", "step-6"), **settings)
    assert resumed.records[0].resumed_at_step == 6
    assert _apart(straight.model, resumed.model) < 1e-6


def test_a_pydataset_whose_worker_raises_names_the_batch_and_writes_nothing_new(tmp_path):
    x, y = _data()
    model_dir = tmp_path / "run"
    with pytest.raises(GpuparError) as e:
        gpupar.fit(_compiled(), _Batches(x, y, broken=5, workers=2), epochs=1, model_dir=str(model_dir))
    assert "_Batches[5] raised OSError: image 5 is unreadable" in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value.__cause__, OSError)  # the user's error, its traceback printed above the line
    assert not list(model_dir.glob("ckpt-*"))


def test_generators_train_as_model_fit_reads_them():
    x, y = _data()

    def batches():
        for i in range(8):
            yield x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32]

    from_function = gpupar.fit(_compiled(), batches, epochs=2, save=False)  # called once per pass
    assert [r.steps for r in from_function.records] == [8, 8]
    one_pass = gpupar.fit(_compiled(), batches(), epochs=1, steps_per_epoch=8, save=False)
    keras_model, _ = _keras_fit(_compiled(), x, y, batch_size=32, shuffle=False)
    assert _apart(one_pass.model, keras_model) < ATOL
    with pytest.raises(GpuparError, match="have no known length, so an epoch has none; pass steps_per_epoch"):
        gpupar.fit(_compiled(), batches(), save=False)


def test_a_generator_of_inconsistent_batches_is_one_line_naming_the_batch():
    x, y = _data()

    def batches():
        for i in range(8):
            yield (x[i * 32:(i + 1) * 32] if i != 3 else x[:32, :5]), y[i * 32:(i + 1) * 32]

    with pytest.raises(GpuparError) as e:
        gpupar.fit(_compiled(), batches, epochs=1, save=False)
    assert "batch 3 has shape (32, 5) where the first batches had (None, 6)" in str(e.value)
    assert "\n" not in str(e.value)


def test_lists_a_batched_dataset_and_ragged_inputs_train():
    x, y = _data()
    lists = gpupar.fit(_compiled(), x.tolist(), y.tolist(), batch_size=32, shuffle=False, save=False)
    batched = gpupar.fit(_compiled(), tf.data.Dataset.from_tensor_slices((x, y)).batch(32), save=False,
                         strategy="mirrored", virtual_cpus=2)
    assert _apart(lists.model, batched.model) < ATOL and batched.global_batch == 32

    tokens = tf.ragged.constant([[1, 2, 3], [4], [5, 6]] * 32)
    labels = np.array([0, 1, 0] * 32, "int32")

    class Pooled(keras.Model):  # subclassed: keras.Input(ragged=True) is Keras 3.10's and later
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, tokens):
            return self.dense(tf.reduce_mean(tf.cast(tokens, tf.float32), axis=1, keepdims=True))

    def ragged_model():
        model = Pooled()
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    ragged = gpupar.fit(ragged_model, tokens, labels, batch_size=16, save=False)
    assert np.isfinite(ragged.history["loss"][0])


def test_pandas_dataframes_series_and_dicts_of_them_train_as_their_arrays():
    import pandas as pd

    x, y = _data()
    frame, labels = pd.DataFrame(x, columns=list("abcdef")), pd.Series(y)
    from_pandas = gpupar.fit(_compiled(), frame, labels, batch_size=32, shuffle=False, save=False)
    from_numpy = gpupar.fit(_compiled(), x, y, batch_size=32, shuffle=False, save=False)
    assert _apart(from_pandas.model, from_numpy.model) == 0.0

    def two_inputs():
        keras.utils.set_random_seed(1)
        a, b = keras.Input((1,), name="a"), keras.Input((1,), name="b")
        model = keras.Model({"a": a, "b": b}, keras.layers.Dense(4)(keras.layers.Concatenate()([a, b])))
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    named = gpupar.fit(two_inputs, {"a": frame["a"], "b": frame["b"]}, labels, batch_size=32, save=False)
    assert np.isfinite(named.history["loss"][0])


def test_text_vectorization_in_the_model_trains_on_raw_strings_on_two_replicas():
    rng = np.random.default_rng(0)
    words = np.array(["good", "great", "fine", "bad", "awful", "poor"])
    labels = rng.integers(0, 2, 256)
    texts = np.array([" ".join(rng.choice(words[:3] if label else words[3:], 5)) for label in labels], dtype=object)
    vectorize = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=5)
    vectorize.adapt(texts)

    def model_fn():
        model = keras.Sequential([keras.Input((1,), dtype="string"), vectorize, keras.layers.Embedding(20, 8),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[keras.metrics.BinaryAccuracy(threshold=0.0)])
        return model

    result = gpupar.fit(model_fn, texts[:, None], labels.astype("float32"), batch_size=32, epochs=3,
                        strategy="mirrored", virtual_cpus=2, save=False)
    assert result.replicas == 2 and result.history["binary_accuracy"][-1] > 0.9


def test_bad_new_arguments_are_one_line_before_any_step():
    x, y = _data()
    for message, kwargs in [
        ("validation_split takes the last examples of arrays, and x is a tf.data.Dataset",
         dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(32), validation_split=0.2)),
        ("class_weight is only supported for models with a single output (as in Keras)",
         dict(x=x, y={"a": y, "b": y}, class_weight={0: 1.0, 1: 2.0})),
        ("y is given, but x is a tf.data.Dataset", dict(x=tf.data.Dataset.from_tensor_slices(x), y=y)),
        ("batch_size=32 and per_replica_batch_size=8 both set the batch", dict(x=x, y=y, per_replica_batch_size=8)),
        ("train_data is now x (and y), as in model.fit", dict(train_data=(x, y))),
    ]:
        with pytest.raises(GpuparError) as e:
            gpupar.fit(_compiled(), **{"batch_size": 32 if "batch_size" not in kwargs else None, **kwargs}, save=True)
        assert message in str(e.value) and "\n" not in str(e.value), message
        assert not os.path.exists("runs")


def test_a_compiled_model_and_fits_own_loss_are_refused_together():
    with pytest.raises(GpuparError, match="model_fn returns a model compiled with its own loss, and gpupar.fit got loss="):
        gpupar.fit(_compiled(), *_data(), loss="mse", save=False)


def test_run_eagerly_runs_each_step_eagerly_and_trains_as_the_graph_does():
    """compile(run_eagerly=True), Keras' debugging mode: one step per call, no tf.function, the same updates."""
    calls = []
    counter = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: calls.append(batch))
    settings = dict(batch_size=32, epochs=1, shuffle=False, save=False, verbose=0)
    eager = gpupar.fit(_compiled(run_eagerly=True), *_data(), callbacks=[counter], **settings)
    graph = gpupar.fit(_compiled(), *_data(), **settings)
    assert eager.model.run_eagerly and calls == list(range(len(calls))) and len(calls) == eager.records[0].steps
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(eager.model.get_weights(), graph.model.get_weights())) < 1e-6


# --- callbacks, verbose, many fits ----------------------------------------------------------------------------------


def test_lambda_callback_progress_bar_params_and_verbose_as_in_model_fit(capsys):
    seen, params = [], []
    callback = keras.callbacks.LambdaCallback(on_batch_end=lambda batch, logs: seen.append((batch, sorted(logs))),
                                              on_train_begin=lambda logs: params.append(dict(callback.params)))
    gpupar.fit(_compiled(), *_data(), batch_size=32, epochs=2, steps_per_call=4, callbacks=[callback], verbose=0,
               save=False)
    assert seen == [(3, ["accuracy", "loss"]), (7, ["accuracy", "loss"])] * 2
    assert params == [{"verbose": 0, "epochs": 2, "steps": 8}]
    assert "Epoch:" not in capsys.readouterr().out  # verbose=0: no line of progress (a warning may say something)
    gpupar.fit(_compiled(), *_data(), batch_size=32, epochs=2, verbose=2, save=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch:")]
    assert [line[:10] for line in lines] == ["Epoch:[0] ", "Epoch:[1] "]  # one line per epoch


MANY_FITS = """
import gc, sys, weakref, numpy as np, keras, gpupar
gpupar.configure_devices(virtual_cpus=2)
x = np.random.default_rng(0).normal(size=(128, 6)).astype("float32"); y = (x[:, 0] > 0).astype("int32")
def model_fn():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
models = []
for _ in range(12):
    result = gpupar.fit(model_fn, x, y, batch_size=32, epochs=2, validation_data=(x[:64], y[:64]), verbose=0,
                        strategy="mirrored", virtual_cpus=2, save=False)
    models.append(weakref.ref(result.model))
    del result
gc.collect()
print("alive", sum(m() is not None for m in models))
"""


@pytest.mark.slow
def test_twelve_fits_in_one_process_leave_nothing_behind_and_the_process_ends():
    """Each fit's model, pipelines and iterators go when it returns; the process ends without waiting on them."""
    done = subprocess.run([sys.executable, "-c", MANY_FITS], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "alive 0" in done.stdout
    assert "retracing" not in done.stderr  # the K-steps calls made anew by every fit are no fault


def test_tensorflows_start_up_lines_are_told_from_a_scripts_own():
    from gpupar.runtime.startup import start_up_line

    chatter = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "I0000 00:00:1796461724.173709    2055 port.cc:153] oneDNN custom operations are on.",
        "E0000 00:00:1796462954.783105   22854 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error",
        "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow",
        "W0000 00:00:1796462955.775011   22854 dataset.cc:997] Input of GeneratorDatasetOp::Dataset will not be optimized",
    ]
    kept = ["Epoch:[0] loss: 0.5", "E0000 00:00:1796462954.783105   22854 op_kernel.cc:1830] OP_REQUIRES failed",
            "Traceback (most recent call last):"]
    assert all(start_up_line(line) for line in chatter) and not any(start_up_line(line) for line in kept)
