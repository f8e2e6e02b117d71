"""The train step and loop: replica equivalence, steps_per_call, resume, central storage, NaN."""

import os

import numpy as np
import pytest

import gpupar
from gpupar.errors import GpuparError

# Numerical claims are tested with SGD, whose update is the gradient times the learning rate, so a
# wrong scale (the replica count, per-replica batch statistics) shows as a proportional difference;
# Adam divides by the gradients' own size and hides it. Different replica counts only reorder
# float32 sums (relative error ~1e-7 per gradient): after four SGD steps at lr 0.05 matching
# weights agree to ~1e-7, where per-replica batch statistics differ by ~2e-2.
ATOL = 1e-5


def _sgd():
    import keras

    return keras.optimizers.SGD(0.05)


def _fit(idx_dir, **options):
    defaults = dict(data_dir=idx_dir, epochs=1, steps_per_epoch=4, dropout=0.0, seed=0, display_step=100)
    return gpupar.fit_mnist(**{**defaults, **options})


def _max_difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a.model.get_weights(), b.model.get_weights()))


def _initial_weights():
    import keras

    keras.utils.set_random_seed(0)
    return gpupar.build_convnet(0.0, seed=0).get_weights()


@pytest.mark.parametrize("kind", ["mirrored", "central_storage"])
def test_two_replicas_give_the_same_update_as_one_device(shared_idx_dir, kind):
    one = _fit(shared_idx_dir, strategy="one_device", per_replica_batch_size=32, sync_batch_norm=True, optimizer=_sgd())
    two = _fit(shared_idx_dir, strategy=kind, virtual_cpus=2, per_replica_batch_size=16, sync_batch_norm=True, optimizer=_sgd())
    assert one.replicas == 1 and two.replicas == 2 and one.global_batch == two.global_batch == 32
    moved = max(float(np.max(np.abs(w - w0))) for w, w0 in zip(one.model.get_weights(), _initial_weights()))
    assert moved > 100 * ATOL  # training really changed the weights
    assert _max_difference(one, two) < ATOL
    assert abs(one.records[0].train_loss - two.records[0].train_loss) < 1e-4


@pytest.mark.parametrize("kind", ["mirrored", "central_storage"])
def test_dropout_trains_under_every_multi_device_kind(shared_idx_dir, kind):
    result = _fit(shared_idx_dir, strategy=kind, virtual_cpus=2, per_replica_batch_size=16, dropout=0.5)
    assert all(np.isfinite(w).all() for w in result.model.get_weights())


def test_per_replica_batch_norm_is_not_the_same_update(shared_idx_dir):
    """Control for the test above: without synchronized BN the replicas normalise by their half."""
    one = _fit(shared_idx_dir, strategy="one_device", per_replica_batch_size=32, optimizer=_sgd())
    two = _fit(shared_idx_dir, strategy="mirrored", virtual_cpus=2, per_replica_batch_size=16, optimizer=_sgd())
    assert _max_difference(one, two) > 10 * ATOL


def test_steps_per_call_gives_the_same_result_as_single_steps(shared_idx_dir):
    single = _fit(shared_idx_dir, strategy="mirrored", virtual_cpus=2, per_replica_batch_size=16, steps_per_epoch=6, steps_per_call=1)
    # By default a call runs display_step steps: here 4, then the epoch's last 2.
    packed = _fit(shared_idx_dir, strategy="mirrored", virtual_cpus=2, per_replica_batch_size=16, steps_per_epoch=6, display_step=4)
    assert _max_difference(single, packed) < 1e-6
    assert single.records[0].train_loss == pytest.approx(packed.records[0].train_loss, abs=1e-6)


def test_progress_lines_and_epoch_summary(shared_idx_dir, capsys):
    result = _fit(shared_idx_dir, per_replica_batch_size=16, steps_per_epoch=None, epochs=2, display_step=5)
    out = capsys.readouterr().out
    assert "Epoch:[0] [5 / 16] loss: " in out and "Epoch:[1] [16 / 16]" in out
    assert "Epoch:[1] loss: " in out and ", val_accuracy: " in out and "Final: loss: " in out
    assert [r.epoch for r in result.records] == [0, 1] and result.records[1].steps == 16
    assert result.test_accuracy == result.records[-1].test_accuracy


def test_learns_the_synthetic_digits(shared_idx_dir):
    result = _fit(shared_idx_dir, per_replica_batch_size=32, steps_per_epoch=None, epochs=6, learning_rate=1e-2)
    assert result.test_accuracy > 0.5  # chance is 0.1


def test_resume_continues_epochs_and_restores_weights(shared_idx_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    first = _fit(shared_idx_dir, model_dir=model_dir, epochs=2, per_replica_batch_size=16)
    assert sorted(f for f in os.listdir(model_dir) if f.endswith(".index")) == ["ckpt-1.index", "ckpt-2.index"]
    # Nothing left to train: the restored model is exactly the saved one.
    same = _fit(shared_idx_dir, model_dir=model_dir, epochs=2, per_replica_batch_size=16, resume=True)
    assert same.start_epoch == 2 and same.records == [] and _max_difference(first, same) == 0.0
    # A given checkpoint restores into two replicas, and the epoch count goes on from it.
    more = _fit(shared_idx_dir, model_dir=model_dir, epochs=3, strategy="mirrored", virtual_cpus=2,
                per_replica_batch_size=8, resume=os.path.join(model_dir, "ckpt-2"))
    assert more.start_epoch == 2 and [r.epoch for r in more.records] == [2]
    assert os.path.exists(os.path.join(model_dir, "ckpt-3.index"))


def test_max_to_keep_keeps_only_the_newest_checkpoints(shared_idx_dir, tmp_path):
    model_dir = tmp_path / "run"
    _fit(shared_idx_dir, model_dir=str(model_dir), epochs=3, per_replica_batch_size=16, steps_per_epoch=2, max_to_keep=2)
    assert sorted(p.name for p in model_dir.glob("*.index")) == ["ckpt-2.index", "ckpt-3.index"]


def test_resumed_run_matches_an_uninterrupted_one(shared_idx_dir, tmp_path):
    straight = _fit(shared_idx_dir, epochs=3, per_replica_batch_size=16)
    model_dir = str(tmp_path / "run")
    _fit(shared_idx_dir, model_dir=model_dir, epochs=1, per_replica_batch_size=16)
    resumed = _fit(shared_idx_dir, model_dir=model_dir, epochs=3, per_replica_batch_size=16, resume=True)
    assert _max_difference(straight, resumed) < 1e-6


def test_checkpoint_of_another_model_is_a_clear_error(shared_idx_dir, tmp_path):
    import tensorflow as tf

    model_dir = tmp_path / "other"
    tf.train.Checkpoint(model=tf.Module()).save(str(model_dir / "ckpt"))
    path = str(model_dir / "ckpt-1")
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    with pytest.raises(GpuparError, match="cannot restore this checkpoint into the model"):
        _fit(shared_idx_dir, resume=path, per_replica_batch_size=16)
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before


def test_nan_loss_stops_without_overwriting_the_last_checkpoint(shared_idx_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    _fit(shared_idx_dir, model_dir=model_dir, epochs=1, per_replica_batch_size=16)
    index = os.path.join(model_dir, "ckpt-1.index")
    before = open(index, "rb").read(), sorted(os.listdir(model_dir))
    # Adam's steps are ~lr in size, so lr=1e30 overflows the weights and the loss.
    with pytest.raises(GpuparError, match=r"training loss became (nan|inf) at epoch 1, step \d+; stopped without saving"):
        _fit(shared_idx_dir, model_dir=model_dir, epochs=2, per_replica_batch_size=16, resume=True, learning_rate=1e30,
             display_step=1)
    assert (open(index, "rb").read(), sorted(os.listdir(model_dir))) == before


def test_tensorboard_and_metrics_json(shared_idx_dir, tmp_path):
    import json

    import tensorflow as tf

    log_dir, metrics = str(tmp_path / "tb"), str(tmp_path / "out" / "metrics.json")
    result = _fit(shared_idx_dir, per_replica_batch_size=16, epochs=2, log_dir=log_dir, metrics_json=metrics, display_step=2)
    tags = {}
    for name in os.listdir(log_dir):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(log_dir, name)):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
    assert tags["step/loss"] == [2, 4, 6, 8] and tags["step/accuracy"] == [2, 4, 6, 8]
    for tag in ("epoch/loss", "epoch/accuracy", "epoch/val_loss", "epoch/val_accuracy", "epoch/examples_per_second",
                "epoch/input_wait_fraction"):
        assert tags[tag] == [0, 1]
    saved = json.load(open(metrics))
    assert saved["logs"]["val_accuracy"] == result.test_accuracy and len(saved["history"]) == 2
    assert set(saved["history"][0]) == {"epoch", "logs", "seconds", "examples_per_second", "steps", "skipped_steps",
                                        "input_wait_fraction", "gpu_util_percent", "gpu_memory_used_mb",
                                        "resumed_at_step", "updates_by_worker"}
    assert set(saved["history"][0]["logs"]) == {"loss", "accuracy", "val_loss", "val_accuracy"}


def test_fit_on_tfds_mock_data():
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=64):
        result = gpupar.fit_mnist(dataset="mnist", epochs=1, per_replica_batch_size=16, display_step=100)
    assert result.records[0].steps == 4 and result.global_batch == 16


@pytest.fixture(scope="module")
def plain(shared_idx_dir):
    """The float32 one-device run that the XLA and 16-bit runs are held to: the same run, made once per worker.

    save=False: a module fixture runs before the per-test chdir into tmp_path, so a saving run would write into
    (and lock) the runs/ folder of wherever pytest started, shared by every worker.
    """
    return _fit(shared_idx_dir, strategy="one_device", per_replica_batch_size=32, save=False)


def _update(result):
    """The change training made to the weights, as one vector."""
    return np.concatenate([(w - w0).ravel() for w, w0 in zip(result.model.get_weights(), _initial_weights())])


def _cosine(a, b):
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.slow
def test_jit_compile_compiles_the_step_and_keeps_the_update(shared_idx_dir, plain, capsys):
    compiled = _fit(shared_idx_dir, strategy="one_device", per_replica_batch_size=32, jit_compile=True)
    assert "step: float32, compiled with XLA" in capsys.readouterr().out
    # XLA's own convolutions and fusions round differently: the same update to float32 rounding.
    assert _max_difference(plain, compiled) < 10 * ATOL and _cosine(_update(plain), _update(compiled)) > 0.999


def test_jit_compile_puts_each_replica_step_in_one_xla_computation():
    import keras
    import tensorflow as tf

    from gpupar import keras_compat
    from gpupar.models.convnet import build_convnet
    from gpupar.training.steps.compiled import CompiledStep
    from gpupar.training.steps.step import train_function

    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    images, labels = tf.zeros([4, 28, 28, 1]), tf.zeros([4], tf.int32)
    with strategy.scope():
        model, adam = build_convnet(0.0), keras.optimizers.Adam()
        model.compile(optimizer=adam, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        keras_compat.symbolic_build(model, (images, labels))
        adam.build(model.trainable_variables)
    iterator = iter(tf.data.Dataset.from_tensors((images, labels)).repeat())

    def compiled_calls(jit):
        step = CompiledStep(model, adam, jit_compile=jit)
        train = train_function(step, strategy)
        with step.in_call():
            library = train.get_concrete_function(iterator, tf.constant(1), tf.constant(False)).graph.as_graph_def(
            ).library
        return [node.attr["f"].func.name for f in library.function for node in f.node_def
                if node.attr["_XlaMustCompile"].b and "train" in node.attr["f"].func.name]

    assert compiled_calls(True) and not compiled_calls(False)


def test_the_xla_step_is_traced_on_a_full_batchs_static_shape_and_a_smaller_batch_runs_without_it():
    """On a batch of unknown first dimension XLA compiled the step again for every batch (its values taken as
    constants): the full batch must reach the compiled step with its static shape."""
    import tensorflow as tf

    from gpupar.training.inner_loop import InnerLoop

    traced = []

    def train(batch, states):
        traced.append(batch.shape.as_list())
        return tf.reduce_sum(batch), states

    loop = InnerLoop(train, 0.0, jit_compile=True, full_rows=4)
    sizes = [4, 4, 2]  # two full batches, then an epoch's last, smaller one
    batches = iter(tf.data.Dataset.from_generator(lambda: (np.ones([n, 3], np.float32) for n in sizes),
                                                  output_signature=tf.TensorSpec([None, 3])))
    concrete = loop.call.get_concrete_function(batches, tf.constant(1), tf.constant(False))
    assert sorted(traced, key=str) == [[4, 3], [None, 3]]
    library = concrete.graph.as_graph_def().library
    assert any(node.attr["_XlaMustCompile"].b for f in [concrete.graph.as_graph_def(), *library.function]
               for node in getattr(f, "node", getattr(f, "node_def", [])))
    total, _, _ = loop.call(batches, tf.constant(3), tf.constant(False))
    assert float(total) == 30


@pytest.mark.slow
def test_jit_compile_with_several_cpu_replicas_trains_without_xla_and_says_so(shared_idx_dir, caplog):
    caplog.set_level("INFO", "gpupar")
    compiled = _fit(shared_idx_dir, strategy="mirrored", virtual_cpus=2, per_replica_batch_size=16, jit_compile=True)
    plain = _fit(shared_idx_dir, strategy="mirrored", virtual_cpus=2, per_replica_batch_size=16)
    assert "XLA cannot compile tf.distribute's all-reduce between the 2 CPU replicas" in caplog.text
    assert _max_difference(plain, compiled) < ATOL


@pytest.mark.parametrize("precision, dtype", [("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")])
def test_mixed_precision_computes_in_16_bits_and_keeps_the_update(shared_idx_dir, plain, precision, dtype):
    mixed = _fit(shared_idx_dir, strategy="one_device", per_replica_batch_size=32, precision=precision)
    conv = mixed.model.layers[0]
    assert conv.compute_dtype == dtype and conv.kernel.dtype == "float32"  # float32 master weights
    # 16-bit activations and gradients round at ~1e-2 relative: the update points the same way and
    # the loss agrees to that rounding, yet they are not the float32 numbers.
    assert _cosine(_update(plain), _update(mixed)) > 0.95 and _max_difference(plain, mixed) > ATOL
    assert mixed.records[0].train_loss == pytest.approx(plain.records[0].train_loss, rel=2e-2)


def test_mixed_float16_scales_the_loss(shared_idx_dir):
    import keras

    from gpupar.presets.mnist import mnist_run
    from gpupar.presets.mnist_options import MnistOptions
    from gpupar.training.setup import build_trainer

    config, task, mode = mnist_run(gpupar.Config(precision="mixed_float16", per_replica_batch_size=16),
                                   MnistOptions(data_dir=shared_idx_dir))
    trainer = build_trainer(config, task, mode)
    scaled = trainer.loss_scale
    assert isinstance(scaled, keras.optimizers.LossScaleOptimizer) and scaled.dynamic_scale > 1
    assert scaled.inner_optimizer is trainer.optimizer


def test_stop_at_accuracy_ends_after_the_first_epoch_that_reaches_it(shared_idx_dir, capsys):
    result = _fit(shared_idx_dir, per_replica_batch_size=32, steps_per_epoch=None, epochs=8, learning_rate=1e-2,
                  stop_at_accuracy=0.3)
    accuracies = [r.test_accuracy for r in result.records]
    assert accuracies[-1] >= 0.3 and all(a < 0.3 for a in accuracies[:-1]) and len(accuracies) < 8
    assert f"val_accuracy {accuracies[-1]:.4f} reached 0.3; stopping" in capsys.readouterr().out
