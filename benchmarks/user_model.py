"""A model that is not gpupar's, as a user brings it: the benchmarks and the model.fit comparison train it."""

import keras


def user_cnn():
    """Conv 32@3x3, pool, conv 64@3x3, pool, dense 64, 10 logits, on uint8 (28, 28) images."""
    return keras.Sequential([
        keras.Input((28, 28)),
        keras.layers.Rescaling(1 / 255),
        keras.layers.Reshape((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ], name="user_cnn")


def user_loss():
    """The user CNN's loss: it gives logits."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
