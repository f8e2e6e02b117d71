"""The classic MNIST ConvNet: two convolutions and a dense layer, each with batch norm, then 10 logits."""

from typing import Optional

import keras

from gpupar.models.layers import XlaBatchNormalization, replica_consistent_state

NUM_CLASSES = 10
DROPOUT, L2, BN_MOMENTUM = 0.5, 5e-4, 0.9  # build_convnet's defaults
STAGE_ENDS = (7,)  # model_parallel: the convolutions (layers 0-7, to the second pooling) | the dense head


def build_convnet(dropout: float = DROPOUT, sync_batch_norm: bool = False, l2: float = L2, seed: int = 0,
                  dtype: Optional[str] = None, xla_batch_norm: bool = True):
    """The ConvNet: conv 6@5x5, conv 12@5x5, dense 100, each with batch norm, then 10 logits.

    Call it inside `strategy.scope()` so its variables are placed by the strategy. For
    model_parallel it splits after the convolutions (STAGE_ENDS). `dtype` is a Keras dtype policy
    such as "mixed_bfloat16" (None: float32). xla_batch_norm=False uses Keras' own
    BatchNormalization (same variables and results, slower on a CPU).

    Args:
      dropout: Dropout rate before the last layer (Keras' Dropout: gpupar's step draws a mask per replica).
      sync_batch_norm: Batch statistics over the global batch rather than each replica's.
      l2: Weight penalty of the convolution and dense kernels.
      seed: Seed of the initial weights and of the dropout masks.
      dtype: A Keras dtype policy, or None for float32 (the logits are float32 either way).
      xla_batch_norm: XlaBatchNormalization (True) or Keras' BatchNormalization.

    Returns:
      The keras.Sequential model, built.
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
        keras.layers.Dropout(dropout, seed=seed, dtype=dtype),
        # The logits in float32 whatever the policy (Keras' mixed-precision guide): a softmax of
        # bfloat16 logits loses the small probabilities, and predict() gives float32 as users expect.
        keras.layers.Dense(NUM_CLASSES, kernel_initializer=init(), kernel_regularizer=keras.regularizers.L2(l2),
                           dtype="float32"),
    ]
    with replica_consistent_state():
        return keras.Sequential([keras.Input((28, 28, 1)), *layers], name="convnet")
