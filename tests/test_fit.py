"""gpupar.fit on the user's own model and data: replica equivalence, metrics, callbacks, resume, export, bad input."""

import contextlib
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import gpupar
from conftest import fit_data
from gpupar.errors import GpuparError

# SGD, so that a wrong scale of the loss or the gradients (the replica count, a batch split
# wrongly) shows in the weights; 1e-5 is far above float32 reordering and far below any such error.
ATOL = 1e-5


def _data(num=256, seed=0, classes=4):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num, 6)).astype("float32")
    y = (np.argmax(x[:, :classes], axis=1)).astype("int32")
    return x, y


def _dense(l2=0.0, softmax=False):
    def model_fn():
        keras.utils.set_random_seed(1)
        return keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(l2) if l2 else None),
            keras.layers.Dense(4, activation="softmax" if softmax else None),
        ])

    return model_fn


def _fit(model_fn, data, replicas, **options):
    """gpupar.fit with a global batch of 32 (as model.fit's batch_size), on one device or on `replicas` replicas."""
    strategy = options.pop("strategy", "mirrored")
    own_batches = callable(data)  # a dataset_fn's batches are its own
    settings = dict(epochs=1, steps_per_epoch=4, save=False, optimizer=keras.optimizers.SGD(0.1),
                    batch_size=None if own_batches else 32, metrics=["accuracy"],
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    settings.update(options)
    if replicas == 1:
        return gpupar.fit(model_fn, **fit_data(data), strategy="one_device", **settings)
    return gpupar.fit(model_fn, **fit_data(data), strategy=strategy, virtual_cpus=replicas, **settings)


def _difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a.model.get_weights(), b.model.get_weights()))


def _moved(result, model_fn):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(result.model.get_weights(), model_fn().get_weights()))


def _weighted(y):
    return np.where(y == 0, 3.0, 0.5).astype("float32")


@pytest.mark.parametrize("name, loss, model_fn, data", [
    ("a Keras name", "sparse_categorical_crossentropy", _dense(softmax=True), _data()),
    ("a Keras loss object", keras.losses.SparseCategoricalCrossentropy(from_logits=True), _dense(), _data()),
    ("a plain function", lambda y, p: keras.losses.sparse_categorical_crossentropy(y, p, from_logits=True), _dense(),
     _data()),
    ("sample weights", keras.losses.SparseCategoricalCrossentropy(from_logits=True), _dense(), (*_data(),
                                                                                               _weighted(_data()[1]))),
    ("mean_with_sample_weight", keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"), _dense(), (*_data(), _weighted(_data()[1]))),
    ("a kernel regularizer", keras.losses.SparseCategoricalCrossentropy(from_logits=True), _dense(l2=0.01), _data()),
])
def test_two_replicas_give_the_weights_of_one_device(name, loss, model_fn, data):
    one = _fit(model_fn, data, 1, loss=loss)
    two = _fit(model_fn, data, 2, loss=loss)
    assert one.replicas == 1 and two.replicas == 2 and one.global_batch == two.global_batch == 32
    assert _moved(one, model_fn) > 100 * ATOL, name  # the four steps really changed the weights
    assert _difference(one, two) < ATOL, name
    assert one.records[0].train_loss == pytest.approx(two.records[0].train_loss, abs=1e-5)


def test_a_wrong_scale_would_show():
    """Control: the same comparison with the update of the two replicas halved (as a loss divided twice)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    one = _fit(_dense(), _data(), 1, loss=loss)
    halved = _fit(_dense(), _data(), 2, loss=loss, optimizer=keras.optimizers.SGD(0.05))
    assert _difference(one, halved) > 100 * ATOL


def _eval_logs(replicas, eval_data):
    return _fit(_dense(), _data(), replicas, validation_data=eval_data, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")]).logs


def test_metrics_cover_the_whole_eval_set_on_every_replica_count():
    # 97 examples in global batches of 32: the last batch has one example, so one replica gets none.
    x, y = _data(97, seed=3)
    one, two = _eval_logs(1, (x, y)), _eval_logs(2, (x, y))
    assert set(one) == {"loss", "accuracy", "top2", "val_loss", "val_accuracy", "val_top2"}
    for name in one:
        assert one[name] == pytest.approx(two[name], abs=1e-5), name
    # The same numbers as computed over the whole set at once.
    model = _fit(_dense(), _data(), 1, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)).model
    logits = model.predict(x, verbose=0)
    assert one["val_accuracy"] == pytest.approx(np.mean(np.argmax(logits, 1) == y), abs=1e-6)
    expected_loss = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits))
    assert one["val_loss"] == pytest.approx(expected_loss, rel=1e-5)


def test_keras_dropout_draws_another_mask_on_each_replica():
    from gpupar import keras_compat

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        dropout = keras.layers.Dropout(0.5, seed=3)

    def masks(per_replica_seeds):
        @tf.function
        def step():
            def replica():
                with keras_compat.in_replica() if per_replica_seeds else contextlib.nullcontext():
                    return dropout(tf.ones([1, 64]), training=True)

            return strategy.experimental_local_results(strategy.run(replica))

        with keras_compat.per_replica_semantics():
            return [m.numpy() != 0 for m in step()]

    first, second = masks(True)
    assert 0.2 < first.mean() < 0.8 and (first != second).mean() > 0.2
    same_first, same_second = masks(False)  # control: Keras alone draws the same mask on both
    assert (same_first == same_second).all()


def test_per_replica_semantics_entered_from_many_threads_leave_keras_as_it_was():
    """gpupar's calls may run in several threads; once every one has left, Keras' own functions are back."""
    import threading

    from keras.src.losses import loss as keras_loss
    from keras.src.random.seed_generator import SeedGenerator

    from gpupar import keras_compat

    draw, scale = SeedGenerator.next, keras_loss.scale_loss_for_distribution
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        generator = SeedGenerator(5)

    def draw_in_replicas():
        def replica():
            with keras_compat.in_replica():
                return generator.next()
        return [s.numpy().tolist() for s in strategy.experimental_local_results(strategy.run(replica))]

    barrier = threading.Barrier(8)
    inside = []

    def enter():
        with keras_compat.per_replica_semantics():
            barrier.wait()  # all inside at once, then all leave
            inside.append(SeedGenerator.next is not draw)

    threads = [threading.Thread(target=enter) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert inside == [True] * 8
    first, second = draw_in_replicas()
    assert first == second  # outside the context, Keras' own draw: the same seed on both replicas
    assert SeedGenerator.next is draw and keras_loss.scale_loss_for_distribution is scale  # put back
    with keras_compat.per_replica_semantics():
        first, second = draw_in_replicas()
    assert first != second  # control: inside, each replica draws apart


def test_batch_norm_statistics_are_averaged_and_synchronized_batch_norm_matches_one_device():
    def model_fn():
        keras.utils.set_random_seed(2)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                                 keras.layers.BatchNormalization(synchronized=True), keras.layers.Dense(4)])

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    one, two = _fit(model_fn, _data(), 1, loss=loss), _fit(model_fn, _data(), 2, loss=loss)
    assert _difference(one, two) < ATOL
    statistics = [v for v in two.model.non_trainable_variables if "moving" in v.path]
    assert statistics and all(v.value.aggregation == tf.VariableAggregation.MEAN for v in statistics)
    # Central storage refuses to update variables left at aggregation NONE; these train.
    central = _fit(model_fn, _data(), 2, loss=loss, strategy="central_storage")
    assert _difference(one, central) < ATOL


def test_keras_callbacks_work_as_in_model_fit(tmp_path):
    class Counting(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.calls = []

        def on_train_begin(self, logs=None):
            self.calls.append("train_begin")

        def on_epoch_begin(self, epoch, logs=None):
            self.calls.append(f"epoch_begin {epoch}")

        def on_train_batch_end(self, batch, logs=None):
            self.calls.append(f"batch_end {batch} {sorted(logs)}")

        def on_epoch_end(self, epoch, logs=None):
            self.calls.append(f"epoch_end {epoch} {sorted(logs)}")

        def on_train_end(self, logs=None):
            self.calls.append("train_end")

    counting, csv = Counting(), str(tmp_path / "log.csv")
    rates = []
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0)
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: rates.append(float(keras.ops.convert_to_numpy(counting.model.optimizer.learning_rate))))
    result = _fit(_dense(), _data(), 2, validation_data=_data(64, 5), epochs=2, steps_per_epoch=4, steps_per_call=2,
                  callbacks=[counting, keras.callbacks.CSVLogger(csv), schedule, plateau, record],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logs = "['accuracy', 'loss', 'val_accuracy', 'val_loss']"
    assert counting.calls == ["train_begin", "epoch_begin 0", "batch_end 1 ['accuracy', 'loss']",
                              "batch_end 3 ['accuracy', 'loss']", f"epoch_end 0 {logs}", "epoch_begin 1",
                              "batch_end 1 ['accuracy', 'loss']", "batch_end 3 ['accuracy', 'loss']",
                              f"epoch_end 1 {logs}", "train_end"]
    # The schedule sets 0.1, then 0.05; the plateau halves the second (the first epoch sets its best).
    assert rates == pytest.approx([0.1, 0.025])
    lines = open(csv).read().splitlines()
    assert lines[0] == "epoch,accuracy,loss,val_accuracy,val_loss" and len(lines) == 3 and len(result.records) == 2 and result.epoch == [0, 1]


def test_early_stopping_stops_and_stop_training_mid_epoch_saves(tmp_path):
    stopper = keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=100.0)
    result = _fit(_dense(), _data(), 1, validation_data=_data(64, 5), epochs=5, callbacks=[stopper])
    assert len(result.records) == 2  # epoch 1 did not improve by 100: stopped there

    class StopAtStep3(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                self.model.stop_training = True

    model_dir = str(tmp_path / "run")
    stopped = _fit(_dense(), _data(), 1, epochs=3, steps_per_call=1, callbacks=[StopAtStep3()], save=True,
                   model_dir=model_dir)
    # As in model.fit, the epoch ends there and is recorded; gpupar also saves where it stopped.
    assert [record.steps for record in stopped.records] == [3] and len(stopped.history["loss"]) == 1
    assert os.path.exists(os.path.join(model_dir, "within_epoch", "step-3.index"))


def test_stop_at_any_logged_metric():
    result = _fit(_dense(), _data(), 1, validation_data=_data(64, 5), epochs=6, stop_at={"val_loss": 10.0})
    assert len(result.records) == 1  # any loss is below 10 after the first epoch


def test_resume_mid_epoch_on_arrays_ends_with_the_uninterrupted_weights(tmp_path):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    options = dict(loss=loss, epochs=2, steps_per_epoch=None)
    straight = _fit(_dense(), _data(), 2, **options)
    model_dir = str(tmp_path / "run")
    _fit(_dense(), _data(), 2, save=True, model_dir=model_dir, checkpoint_every_steps=3, **{**options, "epochs": 1})
    resumed = _fit(_dense(), _data(), 2, save=True, model_dir=model_dir,
                   resume=os.path.join(model_dir, "within_epoch", "step-6"), **options)
    assert resumed.records[0].resumed_at_step == 6
    assert _difference(straight, resumed) < 1e-6


def _with_dropout():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dropout(0.5, seed=2), keras.layers.Dense(4)])


def _resumed_with_dropout(tmp_path, name):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    options = dict(loss=loss, epochs=2, steps_per_epoch=None)
    model_dir = str(tmp_path / name)
    _fit(_with_dropout, _data(), 2, save=True, model_dir=model_dir, checkpoint_every_steps=3, **{**options, "epochs": 1})
    return _fit(_with_dropout, _data(), 2, save=True, model_dir=model_dir,
                resume=os.path.join(model_dir, "within_epoch", "step-6"), **options), _fit(_with_dropout, _data(), 2,
                                                                                            **options)


def test_keras_dropout_resumes_mid_epoch_with_the_masks_of_an_uninterrupted_run(tmp_path, monkeypatch):
    resumed, straight = _resumed_with_dropout(tmp_path, "run")
    assert _difference(straight, resumed) < 1e-6
    # Control: without the SeedGenerators' states in the checkpoint, the resumed run draws other masks.
    from gpupar.training import checkpoint

    monkeypatch.setattr(checkpoint, "model_random_state", lambda model: [])
    resumed, straight = _resumed_with_dropout(tmp_path, "control")
    assert _difference(straight, resumed) > 1e-3


def test_a_subclassed_multi_output_model_with_dicts():
    class TwoHeads(keras.Model):
        def __init__(self):
            super().__init__()
            self.body = keras.layers.Dense(8, activation="relu")
            self.kind, self.size = keras.layers.Dense(4), keras.layers.Dense(1)

        def call(self, inputs):
            h = self.body(keras.ops.concatenate([inputs["a"], inputs["b"]], axis=-1))
            return {"kind": self.kind(h), "size": self.size(h)}

    x, y = _data()
    data = ({"a": x[:, :3], "b": x[:, 3:]}, {"kind": y, "size": x[:, :1] * 2})
    result = _fit(TwoHeads, data, 2, validation_data=data, loss={
        "kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "size": "mse"},
        metrics={"kind": ["accuracy"], "size": ["mae"]})
    assert set(result.logs) == {"loss", "kind_loss", "size_loss", "kind_accuracy", "size_mae",  # Keras' names
                                "val_loss", "val_kind_loss", "val_size_loss", "val_kind_accuracy", "val_size_mae"}
    assert np.isfinite(list(result.logs.values())).all()


def test_a_dataset_and_a_dataset_fn_give_the_update_of_one_device_on_the_same_batches():
    x, y = _data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))  # batched by gpupar, in order: global batch 32
    one_device = _fit(_dense(), dataset, 1, loss=loss)
    two_replicas = _fit(_dense(), dataset, 2, loss=loss)
    assert one_device.records[0].steps == two_replicas.records[0].steps == 4
    assert _moved(one_device, _dense()) > 100 * ATOL and _difference(one_device, two_replicas) < ATOL

    def dataset_fn(context):  # one input pipeline: its per-replica batches of 16 go to the replicas in turn
        batch = context.get_per_replica_batch_size(32)
        return tf.data.Dataset.from_tensor_slices((x, y)).shard(context.num_input_pipelines,
                                                                 context.input_pipeline_id).batch(batch)

    def eval_fn(context):  # a length TensorFlow cannot tell (a filter): counted once, before training
        return tf.data.Dataset.from_tensor_slices((x[:90], y[:90])).filter(lambda *_: True).batch(16)

    from_fn = _fit(_dense(), dataset_fn, 2, loss=loss, validation_data=eval_fn)
    assert from_fn.records[0].steps == 4 and _difference(from_fn, two_replicas) < ATOL
    whole = keras.metrics.SparseCategoricalAccuracy()
    whole.update_state(y[:90], from_fn.model.predict(x[:90], verbose=0))
    assert from_fn.logs["val_accuracy"] == pytest.approx(float(whole.result()), abs=1e-6)  # all 90, once


def test_a_tfds_name_loads_its_split():
    import tensorflow_datasets as tfds

    def model_fn():
        return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Rescaling(1 / 255), keras.layers.Flatten(),
                                 keras.layers.Dense(10)])

    with tfds.testing.mock_data(num_examples=64):
        result = _fit(model_fn, "tfds:mnist", 1, validation_data="tfds:mnist:test",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_epoch=2)
    assert result.records[0].steps == 2 and "val_accuracy" in result.logs


def _export_and_reload(result, tmp_path, x):
    path = str(tmp_path / "model.keras")
    result.save(path)
    np.save(tmp_path / "x.npy", x)
    script = ("import sys, numpy as np, keras\n"
              "model = keras.models.load_model(sys.argv[1])\n"
              "np.save(sys.argv[3], model.predict(np.load(sys.argv[2]), verbose=0))\n")
    done = subprocess.run([sys.executable, "-c", script, path, str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return np.load(tmp_path / "y.npy")


def test_the_saved_model_loads_in_a_fresh_process_and_predicts_the_same(tmp_path):
    x, y = _data()
    result = _fit(_dense(), (x, y), 2, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    reloaded = _export_and_reload(result, tmp_path, x[:8])
    assert np.allclose(reloaded, result.model.predict(x[:8], verbose=0), atol=1e-6)


def test_the_convnet_exports_as_keras_layers_only(shared_idx_dir, tmp_path):
    result = gpupar.fit_mnist(data_dir=shared_idx_dir, epochs=1, per_replica_batch_size=32, steps_per_epoch=2, save=False,
                              export_path=str(tmp_path / "convnet.keras"))
    x = np.random.default_rng(0).random((4, 28, 28, 1)).astype("float32")
    path = tmp_path / "convnet.keras"
    assert path.exists()
    reloaded = _export_and_reload(result, tmp_path, x)
    assert np.allclose(reloaded, result.model.predict(x, verbose=0), atol=1e-5)
    config = json.loads(__import__("zipfile").ZipFile(tmp_path / "model.keras").read("config.json"))
    assert "gpupar" not in json.dumps(config)  # BatchNormalization and Dropout, not gpupar's layers


def _refused(message, *args, **options):
    settings = dict(save=True, epochs=1, batch_size=16, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(GpuparError) as e:
        gpupar.fit(*args, **{**settings, **options})
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists("runs")  # nothing written


def test_bad_input_is_one_line_before_any_step():
    x, y = _data()
    good = _dense()
    _refused("model is a int; pass a keras.Model (built, as for model.fit) or a function", 3, x, y)
    _refused("model_fn returned a int, not a keras.Model", lambda: 3, x, y)

    class OwnStep(keras.Sequential):
        def train_step(self, data):
            return {}

    _refused("OwnStep has its own train_step", lambda: OwnStep([keras.Input((6,)), keras.layers.Dense(4)]), x, y)
    _refused("batch_size is set, but x is a tf.data.Dataset whose batches are its own", good,
             tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    _refused("is a dataset_fn whose dataset is not batched", good,
             lambda context: tf.data.Dataset.from_tensor_slices((x, y)))
    _refused("validation_data is endless", good, x, y, validation_data=tf.data.Dataset.from_tensor_slices((x, y)).repeat())
    _refused("x: the arrays have different numbers of examples (x 256, y 255)", good, x, y[:-1])
    _refused("the labels reach 0..7, but the model has 4 outputs", good, x, y * 2 + (y == 3))
    _refused("loss: 'crossentropyy' is not a Keras name", good, x, y, loss="crossentropyy")
    _refused("metrics: 'acuracy' is not a Keras name", good, x, y, metrics=["acuracy"])
    _refused("dataset is an option of the MNIST presets (gpupar.fit_mnist)", good, x, y, dataset="mnist")
    _refused("strategy=model_parallel needs stages", good, x, y, strategy="model_parallel", virtual_cpus=2)
    _refused("the model has no loss: compile it with one in model_fn", good, x, y, loss=None)
    _refused("eval_data is now validation_data, as in model.fit", good, x, y, eval_data=(x, y))
    _refused("the loss needs labels, but there is no y", good, (x, y))  # a tuple x is the inputs, as in Keras


EARLY_OPTIMIZER = """
import sys, keras, numpy as np, gpupar
x = np.random.default_rng(0).normal(size=(256, 6)).astype("float32"); y = (x[:, 0] > 0).astype("int64")
optimizer = keras.optimizers.SGD(0.1) if sys.argv[1] == "object" else (lambda: keras.optimizers.SGD(0.1))
result = gpupar.fit(lambda: keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)]), x, y,
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer=optimizer,
                    strategy="mirrored", virtual_cpus=2, batch_size=32, epochs=1, steps_per_epoch=2, save=False)
print("replicas", result.replicas, "learning rate", float(keras.ops.convert_to_numpy(result.model.optimizer.learning_rate)))
"""


@pytest.mark.parametrize("given", ["object", "function"])
def test_an_optimizer_made_before_fit_is_named_as_what_started_tensorflow(given, tmp_path):
    """A Keras optimizer starts TensorFlow when made, before fit can make virtual CPUs; a function does not."""
    done = subprocess.run([sys.executable, "-c", EARLY_OPTIMIZER, given], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    if given == "object":
        error = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 1 and "TensorFlow has already initialised its devices" in error, done.stderr[-2000:]
        assert "started by the optimizer object" in error and "optimizer=lambda: keras.optimizers.SGD(...)" in error
    else:
        assert done.returncode == 0, done.stderr[-2000:]
        assert "replicas 2 learning rate 0.1" in done.stdout


def _mean_loss(y, y_pred):
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True))


def test_a_loss_of_one_value_per_batch_is_the_replicas_mean_and_said_so(caplog):
    caplog.set_level("INFO", "gpupar")
    per_example = _fit(_dense(), _data(), 1)
    batch_level = _fit(_dense(), _data(), 2, loss=_mean_loss)  # equal shares: the mean of the replicas' means
    assert _difference(per_example, batch_level) < ATOL
    assert "loss '_mean_loss' gives one value per batch, not one per example" in caplog.text


@pytest.mark.slow
def test_a_users_cnn_reaches_what_model_fit_reaches_on_fashion_mnist(tmp_path):
    """The issue's user CNN, mirrored on 2 replicas, one epoch of the real Fashion-MNIST each way."""
    from conftest import ROOT

    out = tmp_path / "versus.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.versus_fit", "--epochs=1", f"--json={out}"],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["gpupar.fit"]["val_accuracy"][0] > 0.75  # chance is 0.10
    # Two runs of one recipe whose data orders differ: after one epoch their accuracies differ by
    # run-to-run noise (over 0.01 in one CI run), not by a defect, which would cost far more.
    assert abs(report["gpupar.fit"]["val_accuracy"][0] - report["model.fit"]["val_accuracy"][0]) < 0.02


def test_the_metrics_file_keeps_every_finished_epoch_when_a_run_dies(tmp_path):
    class Crash(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("the machine went away")

    model_dir, metrics = str(tmp_path / "run"), tmp_path / "run" / "metrics.json"
    with pytest.raises(RuntimeError, match="went away"):
        _fit(_dense(), _data(), 1, epochs=3, save=True, model_dir=model_dir, callbacks=[Crash()])
    assert [r["epoch"] for r in json.loads(metrics.read_text())["history"]] == [0, 1]  # written at each epoch's end
    resumed = _fit(_dense(), _data(), 1, epochs=3, save=True, model_dir=model_dir, resume=True)
    assert resumed.start_epoch == 2
    assert [r["epoch"] for r in json.loads(metrics.read_text())["history"]] == [0, 1, 2]
