"""Layers that gpupar uses in place of Keras' own, its augmentation layer, and what keeps replicas consistent."""

import contextlib

import keras
import tensorflow as tf

from gpupar import keras_compat
from gpupar.data.augment import random_affine


@contextlib.contextmanager
def replica_consistent_state():
    """Gives non-trainable variables an aggregation that every strategy can update per replica.

    Keras creates them with aggregation NONE: under MirroredStrategy each replica would keep its
    own diverging copy, and CentralStorageStrategy refuses to update them at all. Float ones
    (batch-norm moving statistics) average across replicas; others (counters that advance alike on
    every replica, such as the state of Keras' SeedGenerators) take the first replica's value.
    A metric's variables (aggregation sum) keep a value per replica, summed when read, as Keras
    3.10 and later make them: Keras 3.8 makes them summed on write, and since Keras adds to a
    variable by assigning its sum, every replica's add then added the old value again.
    """

    def creator(next_creator, **kwargs):
        dtype = kwargs.get("dtype")
        aggregation = kwargs.get("aggregation")
        if not kwargs.get("trainable", True) and dtype is not None:
            if aggregation in (None, tf.VariableAggregation.NONE):
                floating = tf.as_dtype(dtype).is_floating
                kwargs["aggregation"] = (
                    tf.VariableAggregation.MEAN if floating else tf.VariableAggregation.ONLY_FIRST_REPLICA
                )
            elif aggregation == tf.VariableAggregation.SUM and kwargs.get("synchronization") in (
                    None, tf.VariableSynchronization.AUTO):
                kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


def global_seed_generator(strategy):
    """Keras' global SeedGenerator (unseeded keras.random draws), made under `strategy` and shared by its replicas.

    Keras keeps it per thread and makes it on first use, and MirroredStrategy runs each replica
    in a thread of its own: an unseeded draw in a replica's step would make it inside the traced
    step, which TensorFlow refuses (keras-io's VAE fails so under model.fit). Made here once, in
    the strategy's scope, it is the main thread's and every replica thread's
    (keras_compat.share_global_seed_generator), draws apart on each replica, and checkpoints can hold it.
    """
    generator = keras_compat.global_seed_generator()
    if generator is None or keras_compat.variable_strategy(generator.state) is not strategy:
        with strategy.scope(), replica_consistent_state():
            generator = keras.random.SeedGenerator()
    keras_compat.share_global_seed_generator(generator)
    return generator


@tf.function(jit_compile=True, autograph=False)
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


@keras.saving.register_keras_serializable(package="gpupar")
class XlaBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training step runs as one XLA-compiled kernel.

    With few channels (the ConvNet's 6 and 12) TensorFlow's per-channel reductions and the
    element-wise passes around them are most of a CPU step; XLA fuses them, about twice as fast
    forward and backward. Same variables (checkpoints move between the two), same results up to
    float rounding. Synchronized statistics (an all-reduce mid-way) and inference take Keras' path,
    and so does everything once `use_xla` is False (where XLA cannot compile: xla_batch_norm_error).
    """

    use_xla = True

    def call(self, inputs, training=None, mask=None):
        renorm = getattr(self, "renorm", False)  # an attribute Keras 3.15 has and 3.12 has not
        plain = self.scale and self.center and not (self.synchronized or renorm) and mask is None
        if not (self.use_xla and training and self.trainable and plain and self.axis in (-1, len(inputs.shape) - 1)):
            return super().call(inputs, training=training, mask=mask)
        outputs, mean, variance = _normalise_batch(
            inputs, tf.convert_to_tensor(self.gamma), tf.convert_to_tensor(self.beta), self.epsilon)
        self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
        self.moving_variance.assign(self.moving_variance * self.momentum + variance * (1.0 - self.momentum))
        return tf.cast(outputs, self.compute_dtype)


def xla_batch_norm_error(device: str):
    """Why XLA cannot compile the batch norm on `device` (CUDA's ptxas or libdevice missing), or None."""
    try:
        with tf.device(device):
            _normalise_batch(tf.zeros([2, 4]), tf.ones([4]), tf.zeros([4]), 1e-3)
    except (tf.errors.OpError, RuntimeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None


def fall_back_from_xla(model, error) -> bool:
    """Sends the model's XlaBatchNormalization layers down Keras' path when XLA failed (error not None).

    Returns whether any layer changed.
    """
    layers = [layer for layer in keras_compat.all_layers(model) if isinstance(layer, XlaBatchNormalization)]
    if error is None or not layers:
        return False
    for layer in layers:
        layer.use_xla = False
    return True



@keras.saving.register_keras_serializable(package="gpupar")
class RandomAffine(keras.layers.Layer):
    """Randomly shifts, rotates and zooms each image of a batch in training; passes it through otherwise.

    The warp is gpupar.data.augment.random_affine, one batched op on the device. Its seeds come
    from a Keras SeedGenerator, which draws apart on each replica inside gpupar's step
    (replica_seeds) and is checkpointed with the model's random state, so a resumed run warps
    its batches as an uninterrupted run would. XLA has no CPU kernel for the warp, so the layer
    says supports_jit=False, as Keras' own preprocessing layers do.
    """

    def __init__(self, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.supports_jit = False

    def call(self, images, training=None):
        if not training:
            return images
        return random_affine(images, tf.cast(self.seed_generator.next(), tf.int64))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "seed": self.seed}
