"""Simple MNIST convnet, shrunk to synthetic digits.

keras-io source: examples/vision/mnist_convnet.py at commit
02cfe8063b505adc073986c91729f22039f77ad0.

Shrunk: 640 synthetic 28x28 uint8 images with uint8 labels (what keras.datasets.mnist.load_data
returns) instead of MNIST's 60,000, prepared as the example does (/255 to float32, a channel axis,
to_categorical); Conv2D filters 32/64 -> 8/16; epochs 15 -> 2. Same layers, compile arguments and
fit keywords (batch_size=128, epochs, validation_split=0.1).

train(fit, workdir, scale=1, epochs=2): scale multiplies the number of synthetic images (640 *
scale; 1 is the tests' size), epochs overrides the 2 (benchmarks/keras_io.py uses both).
"""

import numpy as np
import keras
from keras import layers

QUICK = True

num_classes = 10
input_shape = (28, 28, 1)


def model_fn():
    # Model and compile from keras-io examples/vision/mnist_convnet.py @ 02cfe80 (filters shrunk).
    model = keras.Sequential(
        [
            keras.Input(shape=input_shape),
            layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),  # 32 in keras-io
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),  # 64 in keras-io
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(),
            layers.Dropout(0.5),
            layers.Dense(num_classes, activation="softmax"),
        ]
    )
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def _synthetic_mnist(n, rng):
    """uint8 (n, 28, 28) images and uint8 (n,) labels; each class a noisy bar pattern of its own."""
    y = rng.integers(0, num_classes, size=n).astype("uint8")
    x = rng.integers(0, 60, size=(n, 28, 28)).astype("int32")
    for i, label in enumerate(y):
        row = 2 + 2 * int(label)
        x[i, row : row + 3, 4:24] += 180
    return np.clip(x, 0, 255).astype("uint8"), y


def train(fit, workdir, scale=1, epochs=2):
    rng = np.random.default_rng(0)
    x_train, y_train = _synthetic_mnist(640 * scale, rng)
    # Data preparation as in keras-io.
    x_train = x_train.astype("float32") / 255
    x_train = np.expand_dims(x_train, -1)
    y_train = keras.utils.to_categorical(y_train, num_classes)

    batch_size = 128  # epochs: 15 in keras-io, 2 by default here
    return fit(x_train, y_train, batch_size=batch_size, epochs=epochs, validation_split=0.1)
