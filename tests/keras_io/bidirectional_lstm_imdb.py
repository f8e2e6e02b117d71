"""Bidirectional LSTM on IMDB, shrunk.

keras-io source: examples/nlp/bidirectional_lstm_imdb.py at commit
0a4be8bbc3ae126f3ca49a0bf173902866ec06f0.

Shrunk: 256 + 64 synthetic reviews as lists of word indices (what keras.datasets.imdb.load_data
returns; labels int64 of shape (N,)) instead of 25,000 + 25,000, padded to maxlen with
pad_sequences (int32) as in the example; max_features 20000 -> 1000, maxlen 200 -> 40,
embedding 128 -> 16, LSTM units 64 -> 8. The model's output is (N, 1) with a sigmoid and loss
"binary_crossentropy", as in the example. Same fit keywords (batch_size=32, epochs=2,
validation_data).

train(fit, workdir, scale=1, epochs=2): scale multiplies the number of synthetic reviews (256 *
scale + 64 * scale; 1 is the tests' size), epochs overrides the 2 (benchmarks/keras_io.py uses both).
"""

import keras
from keras import layers

from ._synthetic import imdb_sequences

QUICK = True

max_features = 1000  # 20000 in keras-io
maxlen = 40  # 200 in keras-io


def model_fn():
    # Input for variable-length sequences of integers
    inputs = keras.Input(shape=(None,), dtype="int32")
    # Embed each integer in a 16-dimensional vector (128 in keras-io)
    x = layers.Embedding(max_features, 16)(inputs)
    # Add 2 bidirectional LSTMs (64 units in keras-io)
    x = layers.Bidirectional(layers.LSTM(8, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(8))(x)
    # Add a classifier
    outputs = layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return model


def train(fit, workdir, scale=1, epochs=2):
    x_train, y_train, x_val, y_val = imdb_sequences(scale, max_features, maxlen, max_words=80)
    return fit(x_train, y_train, batch_size=32, epochs=epochs, validation_data=(x_val, y_val))
