"""The ConvNet's layers: shapes, the L2 terms, Keras' dropout drawn apart per replica and per call, XLA batch norm."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from gpupar.models.convnet import build_convnet
from gpupar import keras_compat
from gpupar.models.layers import XlaBatchNormalization, replica_consistent_state


def test_convnet_shapes_and_l2_in_the_loss():
    model = build_convnet(dropout=0.5, seed=0)
    assert model(tf.zeros([3, 28, 28, 1])).shape == (3, 10)
    assert len(model.losses) == 4  # conv, conv, dense, dense kernels


def _masks(strategy, layer, shape):
    @tf.function
    def run():
        def replica():
            with keras_compat.in_replica():
                return layer(tf.ones(shape), training=True)

        return strategy.run(replica)

    with keras_compat.per_replica_semantics():
        return [(x.numpy() != 0) for x in strategy.experimental_local_results(run())]


def test_the_convnets_dropout_masks_differ_between_replicas_and_calls():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope(), replica_consistent_state():
        model = build_convnet(dropout=0.5, seed=0)
    (layer,) = [layer for layer in model.layers if isinstance(layer, keras.layers.Dropout)]
    state = [v for v in model.variables if "seed_generator" in v.path]
    before = state[0].numpy().copy()
    first = _masks(strategy, layer, [4, 256])
    second = _masks(strategy, layer, [4, 256])
    assert (first[0] != first[1]).mean() > 0.3  # independent masks differ in about half the units
    assert (first[0] != second[0]).mean() > 0.3
    assert not np.array_equal(state[0].numpy(), before)  # the state a checkpoint carries advanced


def _batch_norm_step(layer, x, upstream):
    """(outputs, d/dx, d/dgamma, d/dbeta) of sum(layer(x) * upstream) in training mode."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        total = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
    return [y, *tape.gradient(total, [x, layer.gamma, layer.beta])]


@pytest.mark.parametrize("shape", [(64, 28, 28, 6), (64, 100)])
def test_xla_batch_norm_matches_keras_batch_norm(shape):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(3.0, 2.0, shape), tf.float32)  # an offset mean, as after a conv
    upstream = tf.constant(rng.normal(size=shape), tf.float32)
    ours, theirs = XlaBatchNormalization(momentum=0.9), keras.layers.BatchNormalization(momentum=0.9)
    for layer in (ours, theirs):
        layer.build(shape)
        layer.gamma.assign(rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32))
        layer.beta.assign(rng.normal(size=shape[-1]).astype(np.float32))
    theirs.set_weights(ours.get_weights())
    for a, b in zip(_batch_norm_step(ours, x, upstream), _batch_norm_step(theirs, x, upstream)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-4)
    for a, b in zip(ours.get_weights(), theirs.get_weights()):  # moving statistics updated alike
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert np.abs(ours.moving_mean.numpy()).max() > 0.2  # and they did move
    np.testing.assert_allclose(ours(x, training=False).numpy(), theirs(x, training=False).numpy(), rtol=1e-5, atol=1e-5)


def test_xla_batch_norm_really_compiles_with_xla():
    layer = XlaBatchNormalization()
    layer.build((8, 4))
    graph = tf.function(lambda x: layer(x, training=True)).get_concrete_function(tf.TensorSpec((8, 4))).graph
    calls = [op for op in graph.get_operations() if "PartitionedCall" in op.type]
    assert [op.get_attr("_XlaMustCompile") for op in calls if "_XlaMustCompile" in op.node_def.attr] == [True]


def test_gpupar_layers_round_trip_through_their_config_and_a_keras_file(tmp_path):
    layer = XlaBatchNormalization(momentum=0.8, name="norm")
    again = XlaBatchNormalization.from_config(layer.get_config())
    assert (again.momentum, again.name) == (0.8, "norm")
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), again, keras.layers.Dropout(0.3, seed=4)])
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    model.save(tmp_path / "m.keras")  # registered under the package "gpupar": loads without custom_objects
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert [type(layer).__name__ for layer in loaded.layers][1:] == ["XlaBatchNormalization", "Dropout"]
    assert np.allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
