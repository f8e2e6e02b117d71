"""A functional model with two named inputs, sample weights, two metrics, early stopping, and export.

    python examples/multi_input.py            # TF1: two placeholders in a feed_dict
    python examples/multi_input.py --quick    # a few steps, as the tests run it

The image and a second input (the image's mean brightness per row) reach the model as a dict;
sample weights count the first classes double; EarlyStopping watches val_loss; the trained model
is saved as a .keras file and loaded again with Keras alone.
"""

import sys
import tempfile

import keras
import numpy as np

import gpupar
from gpupar.data.idx import load_idx_dir

quick = "--quick" in sys.argv
# Device settings come before any TensorFlow work, and a Keras metric object makes variables.
gpupar.configure_devices(gpupar.Config(virtual_cpus=2))  # two logical CPU devices stand in for two GPUs
data = load_idx_dir("/usr/share/datasets/fashion-mnist")


def inputs(images):
    pixels = (images / 255.0).astype("float32")
    return {"image": pixels.reshape(len(images), -1), "rows": pixels.mean(axis=2)}


def model_fn():
    image, rows = keras.Input((784,), name="image"), keras.Input((28,), name="rows")
    hidden = keras.layers.Concatenate()([keras.layers.Dense(64, activation="relu")(image),
                                         keras.layers.Dense(16, activation="relu")(rows)])
    return keras.Model({"image": image, "rows": rows}, keras.layers.Dense(10)(hidden))


weights = np.where(data.train_labels < 5, 2.0, 1.0).astype("float32")
result = gpupar.fit(
    model_fn, inputs(data.train_images), data.train_labels, sample_weight=weights,
    validation_data=(inputs(data.test_images), data.test_labels),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=3, name="top3")],
    callbacks=[keras.callbacks.EarlyStopping(monitor="val_loss", patience=1)],
    strategy="mirrored", virtual_cpus=2, batch_size=256, epochs=1 if quick else 5,
    steps_per_epoch=5 if quick else None, save=False,
)
path = f"{tempfile.mkdtemp(prefix='gpupar-export-')}/model.keras"
result.save(path)
reloaded = keras.models.load_model(path)
sample = {name: part[:4] for name, part in inputs(data.test_images).items()}
same = np.allclose(reloaded.predict(sample, verbose=0), result.model.predict(sample, verbose=0), atol=1e-5)
print(f"{len(result.epoch)} epoch(s): {result.logs}; exported to {path}, reloaded with the same predictions: {same}")
