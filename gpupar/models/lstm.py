"""A stacked-LSTM classifier over the 28 rows of an image."""

from typing import Optional

import keras

from gpupar.models.convnet import NUM_CLASSES


def build_lstm(num_layers: int = 3, units: int = 128, seed: int = 0, dtype: Optional[str] = None):
    """A stacked-LSTM classifier: the 28 rows of an image are 28 time steps of 28 pixels.

    num_layers LSTM layers of `units`, then 10 logits from the last LSTM's final output; no batch
    norm and no dropout, so splitting a batch into micro-batches does not change the update. For
    model_parallel it splits into one stage per LSTM layer (stage_ends).

    Args:
      num_layers: LSTM layers.
      units: Units in each.
      seed: Seed of the initial weights.
      dtype: A Keras dtype policy, or None for float32 (the logits are float32 either way).

    Returns:
      The keras.Sequential model, built.
    """
    layers = [keras.layers.Reshape((28, 28), dtype=dtype)]
    for i in range(num_layers):
        layers.append(keras.layers.LSTM(
            units, return_sequences=i < num_layers - 1,
            kernel_initializer=keras.initializers.GlorotUniform(seed=seed * 100 + 2 * i),
            recurrent_initializer=keras.initializers.Orthogonal(seed=seed * 100 + 2 * i + 1), dtype=dtype,
        ))
    # The logits in float32 whatever the policy, as in build_convnet.
    layers.append(keras.layers.Dense(NUM_CLASSES, kernel_initializer=keras.initializers.GlorotUniform(seed=seed * 100 + 99),
                                     dtype="float32"))
    return keras.Sequential([keras.Input((28, 28, 1)), *layers], name="lstm")


def stage_ends(num_layers: int) -> tuple:
    """model_parallel's split of build_lstm(num_layers): the reshape joins the first LSTM, the dense head the last."""
    return tuple(range(1, num_layers))  # layer i (1..num_layers) is LSTM i-1
