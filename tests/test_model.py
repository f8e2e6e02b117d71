"""The ConvNet's layers: shapes, the L2 terms, and dropout that differs per replica."""

import numpy as np
import tensorflow as tf

from gpupar.model import ReplicaDropout, build_convnet, replica_consistent_state


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
