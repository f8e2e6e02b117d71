"""Imbalanced classification: credit card fraud detection (class_weight), shrunk.

keras-io source: examples/structured_data/imbalanced_classification.py at commit
0e2570ad95239574579c493d03eac955af344c24 (Keras 3 version: `import keras`, keras.Input,
ModelCheckpoint "fraud_model_at_epoch_{epoch}.keras").

Shrunk: 1,000 synthetic transactions with 30 float32 features and uint8 targets of shape (N, 1),
about 4% positive (the Kaggle CSV has 284,807, 0.17% positive), split 80/20, class weights
1/count and normalisation as in the example; Dense 256 -> 32; batch_size 2048 -> 128; epochs 30
-> 2; the checkpoints are written into workdir. Same metrics (FN/FP/TN/TP/precision/recall),
optimizer Adam(1e-2), loss and fit keywords (batch_size, epochs, verbose=2, callbacks,
validation_data, class_weight).
"""

import os

import numpy as np
import keras

QUICK = True

num_features = 30


def model_fn():
    model = keras.Sequential(
        [
            keras.Input(shape=(num_features,)),
            keras.layers.Dense(32, activation="relu"),  # 256 in keras-io
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    metrics = [
        keras.metrics.FalseNegatives(name="fn"),
        keras.metrics.FalsePositives(name="fp"),
        keras.metrics.TrueNegatives(name="tn"),
        keras.metrics.TruePositives(name="tp"),
        keras.metrics.Precision(name="precision"),
        keras.metrics.Recall(name="recall"),
    ]
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=metrics)
    return model


def train(fit, workdir):
    rng = np.random.default_rng(0)
    n = 1000
    targets = (rng.random(n) < 0.04).astype("uint8")[:, None]
    features = rng.normal(size=(n, num_features)) * rng.uniform(0.5, 50, size=num_features)
    features[:, :4] += 3.0 * targets  # fraud shifts a few features
    features = features.astype("float32")

    num_val_samples = int(len(features) * 0.2)
    train_features = features[:-num_val_samples]
    train_targets = targets[:-num_val_samples]
    val_features = features[-num_val_samples:]
    val_targets = targets[-num_val_samples:]

    counts = np.bincount(train_targets[:, 0])
    weight_for_0 = 1.0 / counts[0]
    weight_for_1 = 1.0 / counts[1]

    mean = np.mean(train_features, axis=0)
    train_features -= mean
    val_features -= mean
    std = np.std(train_features, axis=0)
    train_features /= std
    val_features /= std

    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(workdir, "fraud_model_at_epoch_{epoch}.keras"))
    ]
    class_weight = {0: weight_for_0, 1: weight_for_1}
    return fit(
        train_features,
        train_targets,
        batch_size=128,  # 2048 in keras-io
        epochs=2,  # 30 in keras-io
        verbose=2,
        callbacks=callbacks,
        validation_data=(val_features, val_targets),
        class_weight=class_weight,
    )
