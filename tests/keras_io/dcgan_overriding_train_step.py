"""DCGAN to generate face images (a GAN that overrides Model.train_step), shrunk.

keras-io source: examples/generative/dcgan_overriding_train_step.py, the Keras 3 version ("Last
modified: 2023/12/21": `import keras`, `keras.random.SeedGenerator(1337)`, `ops.concatenate`,
`LeakyReLU(negative_slope=0.2)`, GANMonitor with its own SeedGenerator(42)). The stored snapshots
of keras-team/keras-io that could be reached hold only pre-Keras-3 versions of this file, so it
was read from the verbatim copy of keras-io's examples/generative/ in Xcoke919/keras-io at commit
67e2c7062095bcae4746153831a1ac547abb9b42 (May 2024); see README.md.

Shrunk: 128 synthetic 32x32 RGB "faces" (a skin-toned ellipse with two dark eyes on a random
background, float32 in [0, 255] as image_dataset_from_directory yields them) instead of CelebA's
202,599 64x64 JPEGs, fed as
tf.data.Dataset.from_tensor_slices(images).shuffle(256, seed=1337).batch(32) in place of
image_dataset_from_directory(..., label_mode=None, image_size=(64, 64), batch_size=32) (which
shuffles and batches the same way, with a random seed), then `.map(lambda x: x / 255.0)` as in
the example; discriminator Conv2D 64/128/128 -> 8/16/16; generator Dense(8*8*128) ->
Dense(4*4*16) and Conv2DTranspose 128/256/512 -> 16/32/64 (three stride-2 steps, 4 -> 32 px);
latent_dim 128 -> 16. Same GAN class (compile(d_optimizer, g_optimizer, loss_fn), d_loss/g_loss
Mean trackers, SeedGenerator(1337), discriminator then generator step with tf.GradientTape),
same optimizers (Adam 1e-4 each), loss (BinaryCrossentropy()) and fit call (dataset, epochs=1,
callbacks=[GANMonitor(num_img=10, latent_dim=latent_dim)]); GANMonitor writes its PNGs into
workdir instead of the current directory.

train(fit, workdir, scale=1, epochs=1): scale multiplies the number of synthetic images (128 *
scale; 1 is the tests' size), epochs overrides the 1 (benchmarks/keras_io.py uses both).
"""

import os

import numpy as np
import keras
import tensorflow as tf
from keras import layers
from keras import ops

QUICK = True

image_size = (32, 32)  # (64, 64) in keras-io
latent_dim = 16  # 128 in keras-io
batch_size = 32


class GAN(keras.Model):
    # From keras-io examples/generative/dcgan_overriding_train_step.py (Keras 3 version), unchanged.
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn
        self.d_loss_metric = keras.metrics.Mean(name="d_loss")
        self.g_loss_metric = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        # Sample random points in the latent space
        batch_size = ops.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )

        # Decode them to fake images
        generated_images = self.generator(random_latent_vectors)

        # Combine them with real images
        combined_images = ops.concatenate([generated_images, real_images], axis=0)

        # Assemble labels discriminating real from fake images
        labels = ops.concatenate(
            [ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0
        )
        # Add random noise to the labels - important trick!
        labels += 0.05 * tf.random.uniform(tf.shape(labels))

        # Train the discriminator
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights)
        )

        # Sample random points in the latent space
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )

        # Assemble labels that say "all real images"
        misleading_labels = ops.zeros((batch_size, 1))

        # Train the generator (note that we should *not* update the weights
        # of the discriminator)!
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

        # Update metrics
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {
            "d_loss": self.d_loss_metric.result(),
            "g_loss": self.g_loss_metric.result(),
        }


class GANMonitor(keras.callbacks.Callback):
    # From keras-io; `directory` added so that the PNGs go into workdir (keras-io: the cwd).
    def __init__(self, num_img=3, latent_dim=128, directory="."):
        self.num_img = num_img
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(42)
        self.directory = directory

    def on_epoch_end(self, epoch, logs=None):
        random_latent_vectors = keras.random.normal(
            shape=(self.num_img, self.latent_dim), seed=self.seed_generator
        )
        generated_images = self.model.generator(random_latent_vectors)
        generated_images *= 255
        generated_images.numpy()
        for i in range(self.num_img):
            img = keras.utils.array_to_img(generated_images[i])
            img.save(os.path.join(self.directory, "generated_img_%03d_%d.png" % (epoch, i)))


def model_fn():
    # Discriminator and generator from keras-io (widths shrunk, 32x32 instead of 64x64).
    discriminator = keras.Sequential(
        [
            keras.Input(shape=image_size + (3,)),
            layers.Conv2D(8, kernel_size=4, strides=2, padding="same"),  # 64 in keras-io
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(16, kernel_size=4, strides=2, padding="same"),  # 128 in keras-io
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(16, kernel_size=4, strides=2, padding="same"),  # 128 in keras-io
            layers.LeakyReLU(negative_slope=0.2),
            layers.Flatten(),
            layers.Dropout(0.2),
            layers.Dense(1, activation="sigmoid"),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input(shape=(latent_dim,)),
            layers.Dense(4 * 4 * 16),  # 8 * 8 * 128 in keras-io
            layers.Reshape((4, 4, 16)),  # (8, 8, 128) in keras-io
            layers.Conv2DTranspose(16, kernel_size=4, strides=2, padding="same"),  # 128
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2DTranspose(32, kernel_size=4, strides=2, padding="same"),  # 256
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2DTranspose(64, kernel_size=4, strides=2, padding="same"),  # 512
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(3, kernel_size=5, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    gan = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0001),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0001),
        loss_fn=keras.losses.BinaryCrossentropy(),
    )
    return gan


def _synthetic_faces(n, rng):
    """float32 (n, 32, 32, 3) in [0, 255]: a skin-toned ellipse with two dark eyes on a random
    background."""
    h, w = image_size
    yy, xx = np.mgrid[0:h, 0:w].astype("float32")
    images = np.empty((n, h, w, 3), dtype="float32")
    for i in range(n):
        background = rng.uniform(0, 255, size=3)
        skin = np.array([220.0, 170.0, 130.0]) * rng.uniform(0.6, 1.1)
        cy, cx = h / 2 + rng.normal(0, 1.5), w / 2 + rng.normal(0, 1.5)
        ry, rx = h * rng.uniform(0.32, 0.42), w * rng.uniform(0.25, 0.33)
        face = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1
        image = np.where(face[..., None], skin, background)
        for ex in (cx - rx * 0.4, cx + rx * 0.4):
            eye = (yy - (cy - ry * 0.25)) ** 2 + (xx - ex) ** 2 <= (w / 20) ** 2
            image[eye] = 30.0
        image += rng.normal(0, 8, size=image.shape)
        images[i] = np.clip(image, 0, 255)
    return images


def train(fit, workdir, scale=1, epochs=1):
    rng = np.random.default_rng(0)
    images = _synthetic_faces(128 * scale, rng)  # CelebA: 202,599 images

    # keras-io: keras.utils.image_dataset_from_directory("celeba_gan", label_mode=None,
    # image_size=(64, 64), batch_size=32), which shuffles (buffer batch_size * 8, a random seed)
    # and batches float32 images; here the same from memory, with a fixed seed.
    dataset = tf.data.Dataset.from_tensor_slices(images).shuffle(batch_size * 8, seed=1337)
    dataset = dataset.batch(batch_size)
    dataset = dataset.map(lambda x: x / 255.0)

    # epochs: "In practice, use ~100 epochs" (keras-io's comment; its value is 1, as the default here)
    return fit(
        dataset,
        epochs=epochs,
        callbacks=[GANMonitor(num_img=10, latent_dim=latent_dim, directory=workdir)],
    )
