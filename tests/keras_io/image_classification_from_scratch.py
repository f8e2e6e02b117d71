"""Image classification from scratch (small Xception on Cats vs Dogs), shrunk.

keras-io source: examples/vision/image_classification_from_scratch.py at commit
0e918412690b44285f82f699ce19d919fb14cee2 (the Keras 3 version: augmentation applied in the
tf.data pipeline, compile(jit_compile=True), ModelCheckpoint "save_at_{epoch}.keras").

Shrunk: 2 x 60 synthetic JPEG files (random sizes 36-63 px, written with Pillow into
workdir/PetImages/{Cat,Dog}) instead of the 786 MB Kaggle archive, read with
keras.utils.image_dataset_from_directory exactly as the example does (validation_split=0.2,
subset="both", seed=1337) at image_size 32x32 instead of 180x180, batch_size 128 -> 16; the
corrupted-JFIF filter step kept; model widths 32/64/[128, 256, 512, 728]/1024 ->
8/16/[16, 32, 48, 64]/96; epochs 25 -> 2; ModelCheckpoint writes into workdir.
"""

import os

import numpy as np
import keras
from keras import layers

image_size = (32, 32)  # (180, 180) in keras-io
batch_size = 16  # 128 in keras-io


def make_model(input_shape, num_classes):
    # From keras-io examples/vision/image_classification_from_scratch.py @ 0e91841 (widths shrunk).
    inputs = keras.Input(shape=input_shape)

    # Entry block
    x = layers.Rescaling(1.0 / 255)(inputs)
    x = layers.Conv2D(8, 3, strides=2, padding="same")(x)  # 32 in keras-io
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    x = layers.Conv2D(16, 3, padding="same")(x)  # 64 in keras-io
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    previous_block_activation = x  # Set aside residual

    for size in [16, 32, 48, 64]:  # [128, 256, 512, 728] in keras-io
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)

        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)

        # Project residual
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(previous_block_activation)
        x = layers.add([x, residual])  # Add back residual
        previous_block_activation = x  # Set aside next residual

    x = layers.SeparableConv2D(96, 3, padding="same")(x)  # 1024 in keras-io
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)

    x = layers.GlobalAveragePooling2D()(x)
    if num_classes == 2:
        activation = "sigmoid"
        units = 1
    else:
        activation = "softmax"
        units = num_classes

    x = layers.Dropout(0.5)(x)
    outputs = layers.Dense(units, activation=activation)(x)
    return keras.Model(inputs, outputs)


def model_fn():
    model = make_model(input_shape=image_size + (3,), num_classes=2)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="binary_crossentropy",
        metrics=["accuracy"],
        jit_compile=True,  # Enable XLA compilation for faster execution
    )
    return model


def _write_pet_images(root, n_per_class=60, seed=0):
    """JPEG files in root/Cat and root/Dog: noisy images, warm-tinted cats, cool-tinted dogs."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for folder_name, tint in (("Cat", (190, 120, 70)), ("Dog", (70, 120, 190))):
        folder = os.path.join(root, folder_name)
        os.makedirs(folder, exist_ok=True)
        for i in range(n_per_class):
            h, w = rng.integers(36, 64, size=2)
            pixels = np.array(tint) + rng.normal(0, 50, size=(h, w, 3))
            Image.fromarray(np.clip(pixels, 0, 255).astype("uint8")).save(
                os.path.join(folder, f"{i}.jpg"), quality=90
            )


def train(fit, workdir):
    import tensorflow as tf

    pet_images = os.path.join(workdir, "PetImages")
    _write_pet_images(pet_images)

    # Filter out corrupted images (as in keras-io; the synthetic files all carry "JFIF").
    num_skipped = 0
    for folder_name in ("Cat", "Dog"):
        folder_path = os.path.join(pet_images, folder_name)
        for fname in os.listdir(folder_path):
            fpath = os.path.join(folder_path, fname)
            try:
                fobj = open(fpath, "rb")
                is_jfif = tf.compat.as_bytes("JFIF") in fobj.peek(10)
            finally:
                fobj.close()
            if not is_jfif:
                num_skipped += 1
                os.remove(fpath)
    assert num_skipped == 0, num_skipped

    train_ds, val_ds = keras.utils.image_dataset_from_directory(
        pet_images,
        validation_split=0.2,
        subset="both",
        seed=1337,
        image_size=image_size,
        batch_size=batch_size,
    )

    data_augmentation = keras.Sequential(
        [
            layers.RandomFlip("horizontal"),
            layers.RandomRotation(0.1),
        ]
    )
    train_ds = train_ds.prefetch(buffer_size=32)
    val_ds = val_ds.prefetch(buffer_size=32)
    # Apply `data_augmentation` to the training images.
    train_ds = train_ds.map(
        lambda img, label: (data_augmentation(img), label),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    # Prefetching samples in GPU memory helps maximize GPU utilization.
    train_ds = train_ds.prefetch(tf.data.AUTOTUNE)

    epochs = 2  # 25 in keras-io
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(workdir, "save_at_{epoch}.keras")),
    ]
    return fit(
        train_ds,
        epochs=epochs,
        callbacks=callbacks,
        validation_data=val_ds,
    )
