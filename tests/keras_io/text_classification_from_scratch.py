"""Text classification from scratch (1D convnet on raw IMDB text files), shrunk.

keras-io source: examples/nlp/text_classification_from_scratch.py at commit
01ae2db402523e96f804c6fc3b0a59582e6a671e (Keras 3 version, last modified 2026/02/02).

Shrunk: 240 synthetic reviews written as text files into workdir/aclImdb/train/{pos,neg} (with
"<br />" tags and punctuation for the custom standardization to strip) instead of the 25,000
IMDB files, read with keras.utils.text_dataset_from_directory exactly as the example does
(batch_size=32, validation_split=0.2, subset training/validation, seed=1337,
class_names=["pos", "neg"]). TextVectorization is adapted on the training text and applied in the
tf.data pipeline (option 2 of the example): fit receives a tf.data.Dataset of batched int64
token ids. max_features 20000 -> 1000, embedding_dim 128 -> 16, sequence_length 500 -> 64,
Conv1D/Dense widths 128 -> 16, epochs 3 -> 2.
"""

import os
import re
import string

import numpy as np
import keras
from keras import layers

from ._synthetic import review

QUICK = True

# Model constants (keras-io: 20000, 128, 500).
max_features = 1000
embedding_dim = 16
sequence_length = 64
batch_size = 32

def _write_imdb(root, n_per_class=120, seed=0):
    rng = np.random.default_rng(seed)
    for sub, positive in (("pos", True), ("neg", False)):
        folder = os.path.join(root, "train", sub)
        os.makedirs(folder, exist_ok=True)
        for i in range(n_per_class):
            with open(os.path.join(folder, f"{i}_{7 if positive else 2}.txt"), "w") as f:
                f.write(review(rng, positive))


def custom_standardization(input_data):
    # From keras-io: lowercase, strip "<br />" tags and punctuation.
    import tensorflow as tf

    lowercase = tf.strings.lower(input_data)
    stripped_html = tf.strings.regex_replace(lowercase, "<br />", " ")
    return tf.strings.regex_replace(stripped_html, f"[{re.escape(string.punctuation)}]", "")


def model_fn():
    # Model and compile from keras-io @ 01ae2db (widths shrunk).
    # A integer input for vocab indices.
    inputs = keras.Input(shape=(None,), dtype="int64")
    x = layers.Embedding(max_features, embedding_dim)(inputs)
    x = layers.Dropout(0.5)(x)
    # Conv1D + global max pooling
    x = layers.Conv1D(16, 7, padding="valid", activation="relu", strides=3)(x)  # 128 in keras-io
    x = layers.Conv1D(16, 7, padding="valid", activation="relu", strides=3)(x)  # 128 in keras-io
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(16, activation="relu")(x)  # 128 in keras-io
    x = layers.Dropout(0.5)(x)
    predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
    model = keras.Model(inputs, predictions)
    model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def train(fit, workdir):
    import tensorflow as tf

    dataset_dir = os.path.join(workdir, "aclImdb")
    _write_imdb(dataset_dir)
    train_dir = os.path.join(dataset_dir, "train")

    raw_train_ds = keras.utils.text_dataset_from_directory(
        train_dir,
        batch_size=batch_size,
        validation_split=0.2,
        subset="training",
        seed=1337,
        class_names=["pos", "neg"],
    )
    raw_val_ds = keras.utils.text_dataset_from_directory(
        train_dir,
        batch_size=batch_size,
        validation_split=0.2,
        subset="validation",
        seed=1337,
        class_names=["pos", "neg"],
    )

    vectorize_layer = keras.layers.TextVectorization(
        standardize=custom_standardization,
        max_tokens=max_features,
        output_mode="int",
        output_sequence_length=sequence_length,
    )
    text_ds = raw_train_ds.map(lambda x, y: x)
    vectorize_layer.adapt(text_ds)

    def vectorize_text(text, label):
        text = tf.expand_dims(text, -1)
        return vectorize_layer(text), label

    # Vectorize the data.
    train_ds = raw_train_ds.map(vectorize_text)
    val_ds = raw_val_ds.map(vectorize_text)
    # Do async prefetching / buffering of the data for best performance on GPU.
    train_ds = train_ds.cache().prefetch(buffer_size=10)
    val_ds = val_ds.cache().prefetch(buffer_size=10)

    epochs = 2  # 3 in keras-io
    return fit(train_ds, validation_data=val_ds, epochs=epochs)
