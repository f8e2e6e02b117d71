"""Your own Keras model on NumPy arrays, mirrored over every device.

    python examples/custom_model.py            # TF1: towers of your model + average_gradients
    python examples/custom_model.py --quick    # a few steps, as the tests run it

A small CNN of its own (not gpupar's), written as Keras' multi-GPU guide writes it, with its two
renames: gpupar.strategy(...) for tf.distribute.MirroredStrategy(), gpupar.fit(model, ...) for
model.fit(...). gpupar averages the loss over the global batch, draws Keras' dropout masks apart
on each replica and evaluates on the test set after every epoch. On a machine with GPUs, drop
virtual_cpus: the same strategy mirrors over them.
"""

import sys

import keras

import gpupar
from gpupar.data.idx import load_idx_dir

quick = "--quick" in sys.argv
strategy = gpupar.strategy("mirrored", virtual_cpus=2)  # two logical CPU devices stand in for two GPUs
data = load_idx_dir("/usr/share/datasets/fashion-mnist")  # uint8 images (N, 28, 28), int labels

with strategy.scope():
    model = keras.Sequential([
        keras.Input((28, 28)),
        keras.layers.Rescaling(1 / 255),
        keras.layers.Reshape((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

result = gpupar.fit(
    model, data.train_images, data.train_labels, validation_data=(data.test_images, data.test_labels),
    batch_size=256, epochs=1, steps_per_epoch=5 if quick else None, save=False,  # 128 per replica
)
print(f"{result.strategy_description.split(';')[0]}: val_accuracy {result.logs['val_accuracy']:.4f}")
