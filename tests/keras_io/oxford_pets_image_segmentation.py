"""Image segmentation with a U-Net-like architecture (Oxford Pets) fed by a PyDataset, shrunk.

keras-io source: examples/vision/oxford_pets_image_segmentation.py at commit
0c3c019ffc3f2650b5bfe3c822e0c60a815cf9e8 (the version with the `OxfordPets(keras.utils.Sequence)`
batch loader; keras.utils.Sequence is keras.utils.PyDataset in Keras 3).

Shrunk: 96 synthetic RGB images and trimaps held in memory instead of 7,390 JPEG/PNG files
(inputs float32 (B, 32, 32, 3) in [0, 255], targets uint8 (B, 32, 32, 1) in {0, 1, 2} after the
example's "- 1"); img_size (160, 160) -> (32, 32); batch_size 32 -> 8; val_samples 1000 -> 24
(same random.Random(1337) shuffles); U-Net widths 32/[64, 128, 256]/[256, 128, 64, 32] ->
8/[8, 16, 32]/[32, 16, 8, 4]; epochs 15 -> 2. Same compile (rmsprop,
sparse_categorical_crossentropy), callbacks (ModelCheckpoint with save_best_only=True) and fit
keywords (epochs, validation_data=val_gen, callbacks).

Deviations: `OxfordPets` takes the in-memory arrays instead of file paths (load_img(path,
target_size) becomes indexing an array already of img_size) and takes **kwargs passed to
PyDataset.__init__, so that workers=2 is a constructor argument (Keras 3's way; the example's
Sequence had no such argument). The checkpoint is workdir/oxford_segmentation.keras instead of
"oxford_segmentation.h5". The example's keras.backend.clear_session() before building the model
is left out (model_fn may be called inside another fit's distribution scope).

train(fit, workdir, scale=1, epochs=2): scale multiplies the number of synthetic images and the
validation share (96 * scale, 24 * scale of them held out; 1 is the tests' size), epochs
overrides the 2 (benchmarks/keras_io.py uses both).
"""

import os
import random

import numpy as np
import keras
from keras import layers

QUICK = True

img_size = (32, 32)  # (160, 160) in keras-io
num_classes = 3
batch_size = 8  # 32 in keras-io


class OxfordPets(keras.utils.PyDataset):
    """Helper to iterate over the data (as Numpy arrays)."""

    def __init__(self, batch_size, img_size, input_imgs, target_imgs, **kwargs):
        super().__init__(**kwargs)
        self.batch_size = batch_size
        self.img_size = img_size
        self.input_imgs = input_imgs
        self.target_imgs = target_imgs

    def __len__(self):
        return len(self.target_imgs) // self.batch_size

    def __getitem__(self, idx):
        """Returns tuple (input, target) correspond to batch #idx."""
        i = idx * self.batch_size
        batch_input_imgs = self.input_imgs[i : i + self.batch_size]
        batch_target_imgs = self.target_imgs[i : i + self.batch_size]
        x = np.zeros((self.batch_size,) + self.img_size + (3,), dtype="float32")
        for j, img in enumerate(batch_input_imgs):
            x[j] = img
        y = np.zeros((self.batch_size,) + self.img_size + (1,), dtype="uint8")
        for j, img in enumerate(batch_target_imgs):
            y[j] = np.expand_dims(img, 2)
            # Ground truth labels are 1, 2, 3. Subtract one to make them 0, 1, 2:
            y[j] -= 1
        return x, y


def get_model(img_size, num_classes):
    # From keras-io @ 0c3c019 (widths shrunk).
    inputs = keras.Input(shape=img_size + (3,))

    ### [First half of the network: downsampling inputs] ###

    # Entry block
    x = layers.Conv2D(8, 3, strides=2, padding="same")(inputs)  # 32 in keras-io
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    previous_block_activation = x  # Set aside residual

    # Blocks 1, 2, 3 are identical apart from the feature depth.
    for filters in [8, 16, 32]:  # [64, 128, 256] in keras-io
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)

        # Project residual
        residual = layers.Conv2D(filters, 1, strides=2, padding="same")(previous_block_activation)
        x = layers.add([x, residual])  # Add back residual
        previous_block_activation = x  # Set aside next residual

    ### [Second half of the network: upsampling inputs] ###

    for filters in [32, 16, 8, 4]:  # [256, 128, 64, 32] in keras-io
        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.UpSampling2D(2)(x)

        # Project residual
        residual = layers.UpSampling2D(2)(previous_block_activation)
        residual = layers.Conv2D(filters, 1, padding="same")(residual)
        x = layers.add([x, residual])  # Add back residual
        previous_block_activation = x  # Set aside next residual

    # Add a per-pixel classification layer
    outputs = layers.Conv2D(num_classes, 3, activation="softmax", padding="same")(x)

    # Define the model
    model = keras.Model(inputs, outputs)
    return model


def model_fn():
    model = get_model(img_size, num_classes)
    # We use the "sparse" version of categorical_crossentropy
    # because our target data is integers.
    model.compile(optimizer="rmsprop", loss="sparse_categorical_crossentropy")
    return model


def _pets(n, rng):
    """Lists of uint8 RGB images and uint8 trimaps with values 1 (pet), 2 (background), 3 (border)."""
    yy, xx = np.mgrid[: img_size[0], : img_size[1]]
    input_imgs, target_imgs = [], []
    for _ in range(n):
        cy, cx = rng.uniform(8, 24, size=2)
        r = rng.uniform(5, 11)
        d = np.hypot(yy - cy, xx - cx)
        trimap = np.where(d < r - 1, 1, np.where(d > r + 1, 2, 3)).astype("uint8")
        colours = np.array([[200, 150, 90], [60, 90, 60], [130, 120, 80]])
        img = colours[trimap - 1] + rng.normal(0, 30, size=img_size + (3,))
        input_imgs.append(np.clip(img, 0, 255).astype("uint8"))
        target_imgs.append(trimap)
    return input_imgs, target_imgs


def train(fit, workdir, scale=1, epochs=2):
    input_imgs, target_imgs = _pets(96 * scale, np.random.default_rng(0))

    # Split our images into a training and a validation set (as keras-io splits its paths).
    val_samples = 24 * scale  # 1000 in keras-io
    random.Random(1337).shuffle(input_imgs)
    random.Random(1337).shuffle(target_imgs)
    train_input_imgs = input_imgs[:-val_samples]
    train_target_imgs = target_imgs[:-val_samples]
    val_input_imgs = input_imgs[-val_samples:]
    val_target_imgs = target_imgs[-val_samples:]

    # Instantiate data Sequences for each split
    train_gen = OxfordPets(batch_size, img_size, train_input_imgs, train_target_imgs, workers=2)
    val_gen = OxfordPets(batch_size, img_size, val_input_imgs, val_target_imgs, workers=2)

    callbacks = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(workdir, "oxford_segmentation.keras"), save_best_only=True
        )
    ]
    # Train the model, doing validation at the end of each epoch (epochs: 15 in keras-io, 2 by default here).
    return fit(train_gen, epochs=epochs, validation_data=val_gen, callbacks=callbacks)
