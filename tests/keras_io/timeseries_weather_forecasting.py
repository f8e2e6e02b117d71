"""Timeseries forecasting for weather prediction (LSTM on Jena climate windows), shrunk.

keras-io source: examples/timeseries/timeseries_weather_forecasting.py at commit
0a57de48c864d63b80083820e8988368ee5c3149.

Shrunk: 1,500 synthetic 10-minute records of the 14 Jena climate features (float64) instead of
420,551, a NumPy array instead of the pandas DataFrame; the example's 7 selected features,
normalisation with training statistics, 71.5% split and label offsets; windows made with
timeseries_dataset_from_array exactly as in the example; past 720 -> 120, future 72 -> 12
(step 6 kept, so sequence_length 120 -> 20), batch_size 256 -> 64, LSTM 32 -> 8, epochs 10 -> 2.
Same compile (Adam(learning_rate=0.001), "mse"), callbacks (EarlyStopping, ModelCheckpoint with
save_weights_only=True, save_best_only=True) and fit keywords (epochs, validation_data,
callbacks).

Deviations: keras.utils.timeseries_dataset_from_array (the same function the example reaches as
keras.preprocessing.timeseries_dataset_from_array); the checkpoint is
workdir/model_checkpoint.weights.h5 instead of "model_checkpoint.h5" (Keras 3 requires the
".weights.h5" suffix with save_weights_only=True).
"""

import os

import numpy as np
import keras

QUICK = True

split_fraction = 0.715
step = 6
past = 120  # 720 in keras-io
future = 12  # 72 in keras-io
learning_rate = 0.001
batch_size = 64  # 256 in keras-io
epochs = 2  # 10 in keras-io
sequence_length = int(past / step)
num_selected = 7


def model_fn():
    inputs = keras.layers.Input(shape=(sequence_length, num_selected))
    lstm_out = keras.layers.LSTM(8)(inputs)  # 32 in keras-io
    outputs = keras.layers.Dense(1)(lstm_out)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=learning_rate), loss="mse")
    return model


def normalize(data, train_split):
    data_mean = data[:train_split].mean(axis=0)
    data_std = data[:train_split].std(axis=0)
    return (data - data_mean) / data_std


def _jena(n, rng):
    """(n, 14) float64: the 14 Jena features, a daily cycle plus noise around realistic levels."""
    t = np.arange(n) / 144.0  # days
    daily = np.sin(2 * np.pi * t)[:, None]
    level = np.array([990, 9, 282, 5, 76, 13, 9.5, 3.5, 6, 9.6, 1216, 2, 3.5, 175.0])
    spread = np.array([8, 8, 8, 6, 16, 7, 4, 4, 2.5, 4, 40, 1.5, 2.5, 86.0])
    weights = rng.uniform(-1, 1, size=14)
    return level + spread * (weights * daily + 0.3 * rng.normal(size=(n, 14)))


def train(fit, workdir):
    df = _jena(1500, np.random.default_rng(0))
    train_split = int(split_fraction * int(df.shape[0]))

    features = df[:, [0, 1, 5, 7, 8, 10, 11]]
    features = normalize(features, train_split)
    train_data = features[0:train_split]
    val_data = features[train_split:]

    start = past + future
    end = start + train_split
    x_train = train_data[:, :num_selected]
    y_train = features[start:end][:, [1]]

    dataset_train = keras.utils.timeseries_dataset_from_array(
        x_train,
        y_train,
        sequence_length=sequence_length,
        sampling_rate=step,
        batch_size=batch_size,
    )

    x_end = len(val_data) - past - future
    label_start = train_split + past + future
    x_val = val_data[:x_end][:, :num_selected]
    y_val = features[label_start:][:, [1]]

    dataset_val = keras.utils.timeseries_dataset_from_array(
        x_val,
        y_val,
        sequence_length=sequence_length,
        sampling_rate=step,
        batch_size=batch_size,
    )

    path_checkpoint = os.path.join(workdir, "model_checkpoint.weights.h5")
    es_callback = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0, patience=5)
    modelckpt_callback = keras.callbacks.ModelCheckpoint(
        monitor="val_loss",
        filepath=path_checkpoint,
        verbose=1,
        save_weights_only=True,
        save_best_only=True,
    )
    return fit(
        dataset_train,
        epochs=epochs,
        validation_data=dataset_val,
        callbacks=[es_callback, modelckpt_callback],
    )
