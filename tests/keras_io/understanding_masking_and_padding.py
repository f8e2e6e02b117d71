"""A recurrent tagger on the masking guide's model: Embedding(mask_zero=True) -> LSTM -> Dense,
fit on sequences padded with keras.utils.pad_sequences, so that the output carries the
Embedding's padding mask and Keras' plain "sparse_categorical_crossentropy" averages over real
tokens only (no ignore_class: tag 0 is a real tag here, and the padding's labels are 0 too).

keras-io source: guides/understanding_masking_and_padding.py (Scott Zhu, Francois Chollet) at
commit 0845fa96b2b9c5fca8fab94b7278d0adc4d9a1a2 (the tf.keras version; the Keras 3 one on
keras.io, "Last modified: 2023/06/25", builds the same models with `keras` imports). **The guide
trains nothing**: it pads `raw_inputs` with `pad_sequences(raw_inputs, padding="post")` and builds
`Input(shape=(None,), dtype="int32")` -> `Embedding(input_dim=5000, output_dim=16,
mask_zero=True)` -> `LSTM(32)` to show that the mask reaches the LSTM. What is taken from it:
that padding, that input, that Embedding and that LSTM. What is this port's own: the LSTM
returns sequences (`return_sequences=True`, so that it passes the mask on) and a
`Dense(num_tags, activation="softmax")` tags every step; the synthetic tags; the compile
("adam", "sparse_categorical_crossentropy", metrics=["accuracy"]) and the fit (batch_size=32,
epochs=2, validation_data). So this is a construction on a guide's layers, not a keras-io
program (no keras-io program trains a recurrent tagger; see README.md).

Sizes: input_dim 5000 -> 20 (few enough token ids for 2 epochs to learn their tags), output_dim 16
and LSTM 32 kept; 384 + 96 sequences of 3 to 20 token ids (about 40% of the padded positions
are padding), each token's tag one of 5 by the token's id, labels padded as the inputs are.

Entry points: `model_fn()` + `train(fit, workdir)`.
"""

import keras
import numpy as np
from keras import layers

QUICK = True

input_dim = 20  # 5000 in the guide
num_tags = 5


def _tagged_sequences(n, rng):
    """n (token ids, tags) lists of 3 to 20 ids in 1..input_dim-1 (0 is padding); a token's tag is its id's fifth."""
    raw_inputs, raw_tags = [], []
    for _ in range(n):
        tokens = rng.integers(1, input_dim, size=rng.integers(3, 21))
        raw_inputs.append(tokens.tolist())
        raw_tags.append((tokens * num_tags // input_dim).tolist())
    return raw_inputs, raw_tags


def model_fn():
    """The guide's Embedding(mask_zero=True) and LSTM, returning sequences, and a tag per step."""
    inputs = keras.Input(shape=(None,), dtype="int32")
    x = layers.Embedding(input_dim=input_dim, output_dim=16, mask_zero=True)(inputs)
    x = layers.LSTM(32, return_sequences=True)(x)  # LSTM(32) in the guide
    outputs = layers.Dense(num_tags, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def train(fit, workdir):
    rng = np.random.default_rng(0)
    raw_inputs, raw_tags = _tagged_sequences(384 + 96, rng)
    # "post" padding, as the guide recommends for RNN layers; the labels padded the same way.
    padded_inputs = keras.utils.pad_sequences(raw_inputs, padding="post")
    padded_tags = keras.utils.pad_sequences(raw_tags, padding="post")
    x, x_val = padded_inputs[:384], padded_inputs[384:]
    y, y_val = padded_tags[:384], padded_tags[384:]
    return fit(x, y, batch_size=32, epochs=2, validation_data=(x_val, y_val))
