"""The Keras models: the classic MNIST ConvNet and a stacked-LSTM classifier over image rows."""

import contextlib
from typing import Optional, Sequence

import keras
import tensorflow as tf

NUM_CLASSES = 10
# The ConvNet's defaults, shared with the TF1 tower baseline (gpupar.towers).
DROPOUT, L2, BN_MOMENTUM = 0.5, 5e-4, 0.9


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


def build_convnet(dropout: float = DROPOUT, sync_batch_norm: bool = False, l2: float = L2, seed: int = 0,
                  stage_devices: Optional[Sequence[str]] = None, dtype: Optional[str] = None,
                  xla_batch_norm: bool = True):
    """The ConvNet: conv 6@5x5, conv 12@5x5, dense 100, each with batch norm, then 10 logits.

    Call it inside `strategy.scope()` so its variables are placed by the strategy (or pass
    stage_devices, two devices for the convolution and the dense stage, for model_parallel).
    `dtype` is a Keras dtype policy such as "mixed_bfloat16" (None: float32). xla_batch_norm=False
    uses Keras' own BatchNormalization (same variables and results, slower on a CPU).
    """
    counter = iter(range(seed * 100, seed * 100 + 100))

    def init():
        return keras.initializers.TruncatedNormal(stddev=0.01, seed=next(counter))

    def batch_norm():
        layer = XlaBatchNormalization if xla_batch_norm else keras.layers.BatchNormalization
        return layer(momentum=BN_MOMENTUM, synchronized=sync_batch_norm, dtype=dtype)

    def conv(filters):
        return [
            keras.layers.Conv2D(
                filters, 5, padding="same", use_bias=False, kernel_initializer=init(),
                kernel_regularizer=keras.regularizers.L2(l2), dtype=dtype,
            ),
            batch_norm(),
            keras.layers.ReLU(dtype=dtype),
            keras.layers.MaxPooling2D(2, dtype=dtype),
        ]

    layers = [
        *conv(6),
        *conv(12),
        keras.layers.Flatten(dtype=dtype),
        keras.layers.Dense(
            100, use_bias=False, kernel_initializer=init(), kernel_regularizer=keras.regularizers.L2(l2), dtype=dtype,
        ),
        batch_norm(),
        keras.layers.ReLU(dtype=dtype),
        ReplicaDropout(dropout, seed=seed, dtype=dtype),
        keras.layers.Dense(NUM_CLASSES, kernel_initializer=init(), kernel_regularizer=keras.regularizers.L2(l2),
                           dtype=dtype),
    ]
    return staged_sequential("convnet", layers, stage_devices)


def build_lstm(num_layers: int = 3, units: int = 128, seed: int = 0, stage_devices: Optional[Sequence[str]] = None,
               dtype: Optional[str] = None):
    """A stacked-LSTM classifier: the 28 rows of an image are 28 time steps of 28 pixels.

    num_layers LSTM layers of `units`, then 10 logits from the last LSTM's final output; no batch
    norm and no dropout, so splitting a batch into micro-batches does not change the update.
    `dtype` is a Keras dtype policy (None: float32).
    """
    layers = [keras.layers.Reshape((28, 28), dtype=dtype)]
    for i in range(num_layers):
        layers.append(keras.layers.LSTM(
            units, return_sequences=i < num_layers - 1,
            kernel_initializer=keras.initializers.GlorotUniform(seed=seed * 100 + 2 * i),
            recurrent_initializer=keras.initializers.Orthogonal(seed=seed * 100 + 2 * i + 1), dtype=dtype,
        ))
    layers.append(keras.layers.Dense(NUM_CLASSES, kernel_initializer=keras.initializers.GlorotUniform(seed=seed * 100 + 99),
                                     dtype=dtype))
    return staged_sequential("lstm", layers, stage_devices)


def build_model(config, stage_devices: Optional[Sequence[str]] = None):
    """The model config.model names, built with config's options (stage_devices: see staged_sequential)."""
    dtype = None if config.precision == "float32" else config.precision
    if config.model == "lstm":
        return build_lstm(config.lstm_layers, config.lstm_units, seed=config.seed, stage_devices=stage_devices,
                          dtype=dtype)
    return build_convnet(config.dropout, config.sync_batch_norm, seed=config.seed, stage_devices=stage_devices,
                         dtype=dtype)


def model_signature(config) -> dict:
    """The model config builds and the options that shape its variables, as checkpoints record it."""
    if config.model == "lstm":
        return {"model": "lstm", "lstm_layers": config.lstm_layers, "lstm_units": config.lstm_units}
    return {"model": config.model}


def layer_stages(layers) -> list:
    """The pipeline stage of each layer: where a model splits for strategy=model_parallel.

    A new stage starts at each LSTM layer and at Flatten, once the current stage holds a layer
    with weights: the ConvNet splits into its convolutions and its dense head, the LSTM into one
    stage per LSTM layer (the reshape joins the first, the dense head the last).
    """
    stages, stage, weighted = [], 0, False
    for layer in layers:
        if isinstance(layer, (keras.layers.LSTM, keras.layers.Flatten)) and weighted:
            stage, weighted = stage + 1, False
        weighted = weighted or isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense, keras.layers.LSTM))
        stages.append(stage)
    return stages


def num_stages(config) -> int:
    """How many pipeline stages config.model has."""
    return config.lstm_layers if config.model == "lstm" else 2


def staged_sequential(name, layers, stage_devices=None):
    """keras.Sequential([Input((28, 28, 1)), *layers]); with stage_devices, stage k's variables on device k.

    Layers are added one at a time so each builds (creates its variables) under its stage's
    tf.device. The object structure, and so the checkpoint, is the same with or without devices:
    a split model's checkpoint restores into an unsplit one and back.
    """
    stages = layer_stages(layers)
    with replica_consistent_state():
        model = keras.Sequential(name=name)
        model.add(keras.Input((28, 28, 1)))
        for layer, stage in zip(layers, stages):
            with tf.device(stage_devices[stage]) if stage_devices else contextlib.nullcontext():
                model.add(layer)
    return model
