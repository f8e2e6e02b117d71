"""The ConvNet's layers: shapes, the L2 terms, dropout that differs per replica, XLA batch norm."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from gpupar.models.convnet import build_convnet
from gpupar.models.layers import ReplicaDropout, XlaBatchNormalization, replica_consistent_state


def test_convnet_shapes_and_l2_in_the_loss():
    model = build_convnet(dropout=0.5, seed=0)
    assert model(tf.zeros([3, 28, 28, 1])).shape == (3, 10)
    assert len(model.losses) == 4  # conv, conv, dense, dense kernels


def _masks(strategy, layer, shape):
    @tf.function
    def run():
        return strategy.run(lambda: layer(tf.ones(shape), training=True))

    return [(x.numpy() != 0) for x in strategy.experimental_local_results(run())]


def test_dropout_masks_differ_between_replicas_and_calls():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope(), replica_consistent_state():
        layer = ReplicaDropout(0.5, seed=0)
        layer.build((4, 256))
    first = _masks(strategy, layer, [4, 256])
    second = _masks(strategy, layer, [4, 256])
    assert (first[0] != first[1]).mean() > 0.3  # independent masks differ in about half the units
    assert (first[0] != second[0]).mean() > 0.3
    assert int(layer.calls.numpy()) == 2


def test_dropout_keeps_the_expected_value_and_is_identity_at_inference():
    layer = ReplicaDropout(0.25, seed=3)
    x = tf.ones([200, 500])
    y = layer(x, training=True).numpy()
    assert abs((y != 0).mean() - 0.75) < 0.01 and abs(y.mean() - 1.0) < 0.02
    np.testing.assert_array_equal(layer(x, training=False).numpy(), x.numpy())


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


@pytest.mark.parametrize("rate", [-1, 2, 1.0, "half"])
def test_replica_dropout_refuses_a_bad_rate_as_keras_dropout_does(rate):
    with pytest.raises(ValueError, match="Invalid value received for argument `rate`"):
        ReplicaDropout(rate)


def test_replica_dropout_broadcasts_its_mask_over_noise_shape():
    layer = ReplicaDropout(0.5, noise_shape=(None, 1), seed=1)
    kept = layer(tf.ones([64, 32]), training=True).numpy() != 0
    assert (kept.all(axis=1) | ~kept.any(axis=1)).all()  # each row kept or dropped whole
    assert 0.2 < kept[:, 0].mean() < 0.8


def test_gpupar_layers_round_trip_through_their_config_and_a_keras_file(tmp_path):
    layer = ReplicaDropout(0.3, noise_shape=(None, 1), seed=4, name="drop")
    again = ReplicaDropout.from_config(layer.get_config())
    assert (again.rate, again.noise_shape, again.seed, again.name) == (0.3, (None, 1), 4, "drop")
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), XlaBatchNormalization(momentum=0.8), again])
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    model.save(tmp_path / "m.keras")  # registered under the package "gpupar": loads without custom_objects
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert [type(layer).__name__ for layer in loaded.layers][1:] == ["XlaBatchNormalization", "ReplicaDropout"]
    assert np.allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
