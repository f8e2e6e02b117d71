"""The end-to-end example of the guide "Transfer learning & fine-tuning": train a new head on a
frozen base model, then unfreeze the base, recompile with a low learning rate and fit again,
shrunk.

keras-io source: guides/keras_core/transfer_learning.py at commit
aef7bae234634cb9131ac104ff5953be28000fb2 (the Keras 3 version of the guide, "Last modified:
2023/06/25", written for `keras_core`; `import keras_core as keras` / `from keras_core import
layers` are written `keras` here, the same API under its released name). Ported: its closing
section, "An end-to-end example: fine-tuning an image classification model on a cats vs. dogs
dataset" (data pipeline, model, the two compile + fit rounds); the small demonstrations of the
`trainable` attribute before it and the plots are not part of that program.

Shrunk: 128 training and 64 validation synthetic "cats vs dogs" images instead of tfds'
cats_vs_dogs 40% / 10% splits (9,305 / 2,326 images): uint8 RGB images of varied sizes (24 to 48
pixels a side) with int64 labels (1 = "dog", a brighter upper half; 0 = "cat"), in a
tf.data.Dataset of the same element structure and known cardinality as `tfds.load(...,
as_supervised=True)` gives (made with `Dataset.from_generator` + `assert_cardinality`). The
pipeline is the guide's: `keras.layers.Resizing` map (150x150 -> 32x32), the augmentation map
(RandomFlip, RandomRotation) on the training set, `.batch(batch_size).prefetch(AUTOTUNE).cache()`
(batch_size 64, as in the guide). The test split and the closing `model.evaluate(test_ds)` are
left out (the two fits already report validation metrics).

The base model: the guide uses `keras.applications.Xception(weights="imagenet",
input_shape=(150, 150, 3), include_top=False)`. Nothing may be downloaded here, and even
`Xception(weights=None)` at its smallest input (71x71) takes about 47 s on this 2-core CPU for the
two rounds (10.7 s + 35 s, almost all of it tracing the 132-layer model; MobileNetV3Small 22 s,
MobileNet 26 s), so a tiny Xception-like functional base stands in for it (`_base_model`: a
strided Conv2D and a SeparableConv2D, each followed by BatchNormalization and ReLU, then
max-pooling). It is a nested functional model with BatchNormalization
layers, called with `training=False`, as the guide needs; it is not pretrained (weights=None).
Everything after it is the guide's: Rescaling(1/127.5, offset=-1), `base_model(x,
training=False)`, GlobalAveragePooling2D, Dropout(0.2), Dense(1); round 1 Adam() + 2 epochs,
then `base_model.trainable = True`, round 2 Adam(1e-5) + 1 epoch, both with
BinaryCrossentropy(from_logits=True), BinaryAccuracy and `validation_data=validation_ds`.

Causes exercised: transfer learning with fine-tuning (a frozen nested base, a first fit, the base
unfrozen, a recompile with a new optimizer, a second fit of the same model); also a model fit
twice.

Entry point: `script(strategy, fit, workdir)` only. The program fits one model twice and changes
`trainable` and recompiles between the fits, which `model_fn()` + a single `train(fit,
workdir)` can't express (a fit that builds its model from model_fn would start the second round
from fresh weights).
"""

import numpy as np
import keras
from keras import layers

QUICK = True

image_size = 32  # 150 in keras-io


def _cats_vs_dogs(n, seed):
    """What tfds.load("cats_vs_dogs", as_supervised=True) gives: (uint8 (h, w, 3), int64 label), varied sizes."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        h, w = rng.integers(24, 49, size=2)
        label = int(rng.integers(0, 2))
        image = rng.integers(0, 120, size=(h, w, 3))
        if label == 1:  # "dog": a brighter upper half
            image[: h // 2] += 100
        examples.append((image.astype("uint8"), np.int64(label)))
    ds = tf.data.Dataset.from_generator(
        lambda: iter(examples),
        output_signature=(
            tf.TensorSpec(shape=(None, None, 3), dtype=tf.uint8),
            tf.TensorSpec(shape=(), dtype=tf.int64),
        ),
    )
    return ds.apply(tf.data.experimental.assert_cardinality(n))


def _datasets():
    """The guide's data pipeline, on the synthetic splits."""
    from tensorflow import data as tf_data

    # tfds.load("cats_vs_dogs", split=["train[:40%]", "train[40%:50%]", "train[50%:60%]"],
    # as_supervised=True) in keras-io; the test split is left out.
    train_ds = _cats_vs_dogs(128, seed=0)
    validation_ds = _cats_vs_dogs(64, seed=1)

    resize_fn = keras.layers.Resizing(image_size, image_size)  # Resizing(150, 150) in keras-io

    train_ds = train_ds.map(lambda x, y: (resize_fn(x), y))
    validation_ds = validation_ds.map(lambda x, y: (resize_fn(x), y))

    augmentation_layers = [
        layers.RandomFlip("horizontal"),
        layers.RandomRotation(0.1),
    ]

    def data_augmentation(x):
        for layer in augmentation_layers:
            x = layer(x)
        return x

    train_ds = train_ds.map(lambda x, y: (data_augmentation(x), y))

    batch_size = 64

    train_ds = train_ds.batch(batch_size).prefetch(tf_data.AUTOTUNE).cache()
    validation_ds = validation_ds.batch(batch_size).prefetch(tf_data.AUTOTUNE).cache()
    return train_ds, validation_ds


def _base_model():
    """Stands in for keras.applications.Xception(weights="imagenet", input_shape=(150, 150, 3), include_top=False).

    A tiny Xception-like feature extractor (see the module docstring); not pretrained.
    """
    inputs = keras.Input(shape=(image_size, image_size, 3))
    x = layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.SeparableConv2D(16, 3, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
    return keras.Model(inputs, x, name="xception_stand_in")


def script(strategy, fit, workdir):
    """The guide's end-to-end example; what makes variables is in strategy.scope(), model.fit(...) is fit(model, ...)."""
    train_ds, validation_ds = _datasets()

    with strategy.scope():
        base_model = _base_model()  # keras.applications.Xception(weights="imagenet", ...) in keras-io

        # Freeze the base_model
        base_model.trainable = False

        # Create new model on top
        inputs = keras.Input(shape=(image_size, image_size, 3))  # (150, 150, 3) in keras-io

        # Pre-trained Xception weights requires that input be scaled
        # from (0, 255) to a range of (-1., +1.), the rescaling layer
        # outputs: `(inputs * scale) + offset`
        scale_layer = keras.layers.Rescaling(scale=1 / 127.5, offset=-1)
        x = scale_layer(inputs)

        # The base model contains batchnorm layers. We want to keep them in inference mode
        # when we unfreeze the base model for fine-tuning, so we make sure that the
        # base_model is running in inference mode here.
        x = base_model(x, training=False)
        x = keras.layers.GlobalAveragePooling2D()(x)
        x = keras.layers.Dropout(0.2)(x)  # Regularize with dropout
        outputs = keras.layers.Dense(1)(x)
        model = keras.Model(inputs, outputs)

        # Train the top layer
        model.compile(
            optimizer=keras.optimizers.Adam(),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            metrics=[keras.metrics.BinaryAccuracy()],
        )

    epochs = 2
    fit(model, train_ds, epochs=epochs, validation_data=validation_ds)

    # Unfreeze the base_model. Note that it keeps running in inference mode
    # since we passed `training=False` when calling it. This means that
    # the batchnorm layers will not update their batch statistics.
    # This prevents the batchnorm layers from undoing all the training
    # we've done so far.
    base_model.trainable = True

    with strategy.scope():
        model.compile(
            optimizer=keras.optimizers.Adam(1e-5),  # Low learning rate
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            metrics=[keras.metrics.BinaryAccuracy()],
        )

    epochs = 1
    return fit(model, train_ds, epochs=epochs, validation_data=validation_ds)
