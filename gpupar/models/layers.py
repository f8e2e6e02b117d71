"""Layers that gpupar uses in place of Keras' own, and the variable scope that keeps replicas consistent."""

import contextlib

import keras
import tensorflow as tf


@contextlib.contextmanager
def replica_consistent_state():
    """Gives non-trainable variables an aggregation that every strategy can update per replica.

    Keras creates them with aggregation NONE: under MirroredStrategy each replica would keep its
    own diverging copy, and CentralStorageStrategy refuses to update them at all. Float ones
    (batch-norm moving statistics) average across replicas; others (counters that advance alike on
    every replica, such as ReplicaDropout's) take the first replica's value.
    """

    def creator(next_creator, **kwargs):
        dtype = kwargs.get("dtype")
        if (
            not kwargs.get("trainable", True)
            and dtype is not None
            and kwargs.get("aggregation") in (None, tf.VariableAggregation.NONE)
        ):
            floating = tf.as_dtype(dtype).is_floating
            kwargs["aggregation"] = (
                tf.VariableAggregation.MEAN if floating else tf.VariableAggregation.ONLY_FIRST_REPLICA
            )
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


class ReplicaDropout(keras.layers.Layer):
    """Dropout that draws a different mask on every replica.

    Keras' Dropout reads one seed-generator state that is the same on every replica, so under
    MirroredStrategy all replicas drop the same units of their examples. Here the mask comes from
    (seed, call count, replica id) through stateless random ops; the call count is a variable, so
    checkpoints carry it and a resumed run draws the masks an uninterrupted one would.
    """

    def __init__(self, rate: float, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.rate, self.seed = rate, seed

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), dtype="int64", initializer="zeros", trainable=False, name="calls")

    def call(self, inputs, training=False):
        if not training or self.rate == 0:
            return inputs
        context = tf.distribute.get_replica_context()
        replica = tf.cast(context.replica_id_in_sync_group if context else 0, tf.int64)
        count = tf.convert_to_tensor(self.calls)
        self.calls.assign_add(1)
        seed = tf.stack([tf.constant(self.seed, tf.int64) * 1_000_003 + count, replica])
        keep = tf.random.stateless_uniform(tf.shape(inputs), seed=seed) >= self.rate
        return tf.where(keep, inputs / (1.0 - self.rate), tf.zeros_like(inputs))

    def get_config(self):
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}


@tf.function(jit_compile=True)
def _normalise_batch(inputs, gamma, beta, epsilon):
    """Training-mode batch norm as one XLA kernel: (outputs, batch mean, batch variance).

    The same arithmetic as keras.layers.BatchNormalization (tf.nn.moments, then
    tf.nn.batch_normalization), in float32 whatever the input dtype.
    """
    x = tf.cast(inputs, tf.float32)
    axes = list(range(len(x.shape) - 1))
    mean = tf.reduce_mean(x, axes)
    variance = tf.reduce_mean(tf.math.squared_difference(x, tf.stop_gradient(mean)), axes)
    inv = tf.math.rsqrt(variance + epsilon) * gamma
    outputs = x * inv + (beta - mean * inv)
    return tf.cast(outputs, inputs.dtype), mean, variance


class XlaBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training step runs as one XLA-compiled kernel.

    With few channels (the ConvNet's 6 and 12) TensorFlow's per-channel reductions and the
    element-wise passes around them are most of a CPU step; XLA fuses them, about twice as fast
    forward and backward. Same variables (checkpoints move between the two), same results up to
    float rounding. Synchronized statistics (an all-reduce mid-way) and inference take Keras' path.
    """

    def call(self, inputs, training=None, mask=None):
        plain = self.scale and self.center and not (self.synchronized or self.renorm) and mask is None
        if not (training and self.trainable and plain and self.axis in (-1, len(inputs.shape) - 1)):
            return super().call(inputs, training=training, mask=mask)
        outputs, mean, variance = _normalise_batch(
            inputs, tf.convert_to_tensor(self.gamma), tf.convert_to_tensor(self.beta), self.epsilon)
        self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(self.moving_variance * self.momentum + variance * (1.0 - self.momentum))
        return tf.cast(outputs, self.compute_dtype)
