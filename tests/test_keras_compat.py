"""Each private Keras and TensorFlow touch of gpupar/keras_compat.py still reads or does what gpupar relies on.

One test per touch, on the installed pair: where Keras or TensorFlow moves a name, or changes
what it means, the test of that touch fails (make test-versions runs them on every pair the
range admits). The tests of what the touches are for (masked losses, per-replica dropout, an
added loss divided once, models moved under a strategy) are in test_keras_semantics.py,
test_fit.py and test_keras_surface.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import two_replicas
from gpupar import keras_compat


def _compiled(metrics=("mae",)):
    model = keras.Sequential([keras.layers.Dense(3)])  # no Input: built by the symbolic build
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                  metrics=list(metrics))
    return model


def _batch(rows=4):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, 5)).astype("float32"), rng.normal(size=(rows, 3)).astype("float32")


def test_symbolic_build_builds_what_fit_builds_and_leaves_the_optimizer_unbuilt():
    model = _compiled()
    assert not model.built and not model.optimizer.built
    keras_compat.symbolic_build(model, _batch())
    assert model.built and len(model.trainable_variables) == 2
    assert keras_compat.compile_metrics(model).built and keras_compat.compile_loss(model).built
    assert not model.optimizer.built  # gpupar builds it on the variables it updates


def test_the_compile_parts_are_where_gpupar_reads_them():
    mae = keras.metrics.MeanAbsoluteError(name="mae_object")
    model = _compiled(metrics=[mae, "mse"])
    keras_compat.symbolic_build(model, _batch())
    assert keras_compat.loss_tracker(model).name == "loss"
    assert [m.name for m in keras_compat.compile_metrics(model).metrics] == ["mae_object", "mse"]
    assert keras_compat.compile_settings(model)["metrics"][0] is mae  # the object itself, as given
    ((path, loss),) = keras_compat.compiled_losses(model)
    assert isinstance(loss, keras.losses.Loss) and loss.reduction == "sum_over_batch_size"


def test_the_compiled_losses_are_replaced_while_the_block_runs_and_put_back():
    model = _compiled()
    keras_compat.symbolic_build(model, _batch())
    ((_, original),) = keras_compat.compiled_losses(model)
    seen = []

    class Doubled(keras.losses.Loss):
        def __call__(self, y_true, y_pred, sample_weight=None):
            seen.append(True)
            return 2.0 * original(y_true, y_pred, sample_weight)

    x, y = _batch()
    y_pred = model(x)
    plain = float(keras_compat.compile_loss(model)(y, y_pred))
    with keras_compat.compile_losses_replaced(model, lambda loss, path, weight: Doubled()):
        doubled = float(keras_compat.compile_loss(model)(y, y_pred))
    assert seen and doubled == pytest.approx(2 * plain)
    assert keras_compat.compiled_losses(model)[0][1] is original


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight", "sum"])
def test_loss_sums_give_keras_value_when_divided_by_their_count(reduction):
    """Loss.__call__'s steps, stopped before the division: the same masks (ignore_class), weights and reduction."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0, reduction=reduction)
    rng = np.random.default_rng(1)
    y_true = rng.integers(0, 4, size=(6, 5))
    y_pred = rng.normal(size=(6, 5, 4)).astype("float32")
    weight = rng.uniform(0.5, 2.0, size=(6, 1)).astype("float32")  # per sequence, broadcast over its tokens
    total, count, per_batch = keras_compat.loss_sums(loss, y_true, y_pred, weight)
    expected = float(loss(y_true, y_pred, weight))
    ours = float(total) if reduction == "sum" else float(total) / float(count)
    assert ours == pytest.approx(expected, rel=1e-5) and not per_batch
    if reduction == "sum_over_batch_size":
        assert float(count) == np.sum(y_true != 0)  # the real tokens, not every position


def test_strategy_of_and_moving_a_model_under_a_strategy():
    model = _compiled()
    keras_compat.symbolic_build(model, _batch())
    assert keras_compat.strategy_of(model) is None
    strategy = two_replicas()
    with strategy.scope():
        keras_compat.move_variables(model, strategy)
    assert keras_compat.strategy_of(model) is strategy
    assert all(keras_compat.variable_strategy(v) is strategy for v in model.variables)
    assert model.predict(_batch()[0], verbose=0).shape == (4, 3)  # Keras runs it, now under the strategy


def test_all_layers_reaches_nested_layers():
    inner = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2, name="deep")])
    outer = keras.Sequential([keras.Input((5,)), inner, keras.layers.Dense(1)])
    assert "deep" in [layer.name for layer in keras_compat.all_layers(outer)]
    assert outer not in keras_compat.all_layers(outer, include_self=False)


def test_remake_variable_keeps_the_value_on_the_device_it_is_made_on():
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    before = layer.kernel.numpy()
    with tf.device("/cpu:1"):
        keras_compat.remake_variable(layer.kernel)
    assert layer.kernel.value.device.endswith("CPU:1") and np.array_equal(layer.kernel.numpy(), before)


def test_per_replica_semantics_replace_keras_functions_only_while_open():
    from keras.src.losses import loss as keras_loss
    from keras.src.random.seed_generator import SeedGenerator

    scale, draw = keras_loss.scale_loss_for_distribution, SeedGenerator.next
    with keras_compat.per_replica_semantics():
        assert keras_loss.scale_loss_for_distribution is not scale and SeedGenerator.next is not draw
    assert keras_loss.scale_loss_for_distribution is scale and SeedGenerator.next is draw


def test_the_global_seed_generator_is_this_threads_and_shared_with_replica_threads():
    import threading

    generator = keras.random.SeedGenerator(3)
    keras_compat.share_global_seed_generator(generator)
    assert keras_compat.global_seed_generator() is generator
    assert keras.random.normal((1,)).shape == (1,)  # Keras draws from it: its state advanced
    seen = []

    def replica_thread():
        with keras_compat.in_replica():
            seen.append(keras_compat.global_seed_generator())

    thread = threading.Thread(target=replica_thread)
    thread.start()
    thread.join()
    assert seen == [generator]


def test_backup_and_restore_says_its_epoch_where_gpupar_reads_it(tmp_path):
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq="epoch", delete_checkpoint=False)
    model.fit(*_batch(), epochs=2, callbacks=[backup], verbose=0)
    assert keras_compat.initial_epoch(model) is None
    again = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq="epoch")
    again.set_model(model)
    again.on_train_begin()
    assert keras_compat.initial_epoch(model) == 2


def test_an_optimizer_first_built_inside_a_traced_replica_step_makes_its_variables_outside():
    strategy = two_replicas()
    with strategy.scope():
        weights = keras.Variable(np.ones((3,), "float32"))
        optimizer = keras.optimizers.Adam(0.1)

    def step():
        optimizer.apply([tf.ones((3,))], [weights])

    with keras_compat.optimizers_built_outside([optimizer], strategy):
        tf.function(lambda: strategy.run(step)).get_concrete_function()
    assert optimizer.built and "build" not in vars(optimizer)  # built, and the patch is gone


def test_tensorflows_global_generator_is_read_without_making_one():
    from tensorflow.python.ops import stateful_random_ops

    assert keras_compat.tf_global_generator() is stateful_random_ops.global_generator


def test_gpu_descriptions_list_the_runtimes_gpus():
    assert keras_compat.gpu_descriptions() == [] == tf.config.list_physical_devices("GPU")  # no GPU here


def test_a_variable_saved_as_shards_hands_its_values_saveables_to_the_checkpoint():
    variable = keras.Variable(np.ones((2,), "float32"))
    keras_compat.saved_as_shards(variable)
    keras_compat.saved_as_shards(variable)  # once is enough: the class is kept
    assert type(variable).holds_shards and isinstance(variable, keras.Variable)
    assert set(variable._gather_saveables_for_checkpoint()) == set(variable.value._gather_saveables_for_checkpoint())


def test_tensor_spec_of_batches_leaves_the_batch_dimension_unknown():
    batches = [(np.zeros((4, 3), "float32"), np.zeros((4,), "int64")), (np.zeros((2, 3), "float32"),
                                                                          np.zeros((2,), "int64"))]
    spec = keras_compat.tensor_spec_of(batches)
    assert spec[0].shape.as_list() == [None, 3] and spec[1].dtype == tf.int64
