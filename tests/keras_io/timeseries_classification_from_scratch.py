"""Timeseries classification from scratch (FCN on FordA), shrunk.

keras-io source: examples/timeseries/timeseries_classification_from_scratch.py at commit
ad4fc805f5e1a4a4c0bcdd416aa9feac6608fb6c (metrics=["sparse_categorical_accuracy"]).

Shrunk: 200 synthetic univariate series of length 96 (FordA: 3601 of length 500), written as a
FordA-style TSV (label -1/1 in the first column) into workdir and read back with the example's
`readucr` (np.loadtxt: float64 series, int labels), reshaped, shuffled and relabelled as in the
example; Conv1D filters 64 -> 16; epochs 500 -> 2. Same callbacks (ModelCheckpoint with
save_best_only=True, monitor="val_loss"; ReduceLROnPlateau; EarlyStopping), compile arguments and
fit keywords (batch_size=32, epochs, callbacks, validation_split=0.2, verbose=1).

Deviations: the checkpoint is written to workdir/best_model.keras instead of "best_model.h5" in
the working directory (the Keras 3 version of the same example uses "best_model.keras"); the
example's shuffle uses the global np.random.permutation, here a seeded generator.
"""

import os

import numpy as np
import keras

QUICK = True

length = 96  # 500 in FordA
num_classes = 2


def readucr(filename):
    data = np.loadtxt(filename, delimiter="\t")
    y = data[:, 0]
    x = data[:, 1:]
    return x, y.astype(int)


def make_model(input_shape):
    # From keras-io @ ad4fc80 (filters 64 -> 16).
    input_layer = keras.layers.Input(input_shape)

    conv1 = keras.layers.Conv1D(filters=16, kernel_size=3, padding="same")(input_layer)
    conv1 = keras.layers.BatchNormalization()(conv1)
    conv1 = keras.layers.ReLU()(conv1)

    conv2 = keras.layers.Conv1D(filters=16, kernel_size=3, padding="same")(conv1)
    conv2 = keras.layers.BatchNormalization()(conv2)
    conv2 = keras.layers.ReLU()(conv2)

    conv3 = keras.layers.Conv1D(filters=16, kernel_size=3, padding="same")(conv2)
    conv3 = keras.layers.BatchNormalization()(conv3)
    conv3 = keras.layers.ReLU()(conv3)

    gap = keras.layers.GlobalAveragePooling1D()(conv3)

    output_layer = keras.layers.Dense(num_classes, activation="softmax")(gap)

    return keras.models.Model(inputs=input_layer, outputs=output_layer)


def model_fn():
    model = make_model(input_shape=(length, 1))
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )
    return model


def _write_forda(path, n=200, seed=0):
    """FordA-like TSV: label in {-1, 1}, then a z-normalised series (class 1 has a higher frequency)."""
    rng = np.random.default_rng(seed)
    labels = rng.choice([-1, 1], size=n)
    t = np.linspace(0, 8 * np.pi, length)
    freq = np.where(labels == 1, 2.0, 1.0)[:, None]
    series = np.sin(freq * t[None, :] + rng.uniform(0, 2 * np.pi, (n, 1))) + rng.normal(0, 0.5, (n, length))
    series = (series - series.mean(axis=1, keepdims=True)) / series.std(axis=1, keepdims=True)
    np.savetxt(path, np.column_stack([labels, series]), delimiter="\t", fmt="%.6f")


def train(fit, workdir):
    path = os.path.join(workdir, "FordA_TRAIN.tsv")
    _write_forda(path)
    x_train, y_train = readucr(path)
    x_train = x_train.reshape((x_train.shape[0], x_train.shape[1], 1))
    assert len(np.unique(y_train)) == num_classes

    idx = np.random.default_rng(1).permutation(len(x_train))
    x_train = x_train[idx]
    y_train = y_train[idx]
    y_train[y_train == -1] = 0

    epochs = 2  # 500 in keras-io
    batch_size = 32
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(workdir, "best_model.keras"), save_best_only=True, monitor="val_loss"
        ),
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=20, min_lr=0.0001),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=50, verbose=1),
    ]
    return fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=epochs,
        callbacks=callbacks,
        validation_split=0.2,
        verbose=1,
    )
