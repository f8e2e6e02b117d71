"""A GAN with its own train_step (keras-io's DCGAN shape), mirrored, ported from model.fit by the rule.

    python examples/gan.py            # 2 epochs on Fashion-MNIST's images, two replicas
    python examples/gan.py --quick    # a few steps, as the tests run it

The model overrides train_step: two models, two optimizers kept by its own compile(), the
discriminator and the generator updated in turn, latent vectors from a SeedGenerator. gpupar runs
that step on every replica as model.fit does, K steps per tf.function call, and gives it what
model.fit under MirroredStrategy does not: the optimizers built outside the replicated step (there
Keras' fit stops), other latent vectors on each replica (Keras draws the same on all), exact
mid-epoch resume with the trackers' state in the checkpoint. The script, and what changed:

    gan = GAN(...)                                     def model_fn():
    gan.compile(d_optimizer=..., g_optimizer=...,          gan = GAN(...)
                loss_fn=...)                               gan.compile(d_optimizer=..., ...)
    gan.fit(images, batch_size=128, epochs=2)              return gan
                                                       gpupar.fit(model_fn, images, batch_size=128, epochs=2,
                                                                  strategy="mirrored")
"""

import sys

import keras
import tensorflow as tf

import gpupar
from gpupar.data.idx import load_idx_dir

quick = "--quick" in sys.argv
LATENT = 32


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.d_loss_metric, self.g_loss_metric = keras.metrics.Mean(name="d_loss"), keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_metric, self.g_loss_metric]

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        noise = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        combined = tf.concat([self.generator(noise), real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

        noise = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch_size, 1)), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_metric.update_state(d_loss)
        self.g_loss_metric.update_state(g_loss)
        return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}


def model_fn():
    discriminator = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 4, strides=2, padding="same"), keras.layers.LeakyReLU(0.2),
        keras.layers.Conv2D(64, 4, strides=2, padding="same"), keras.layers.LeakyReLU(0.2),
        keras.layers.Flatten(), keras.layers.Dropout(0.2), keras.layers.Dense(1),
    ])
    generator = keras.Sequential([
        keras.Input((LATENT,)),
        keras.layers.Dense(7 * 7 * 64), keras.layers.Reshape((7, 7, 64)),
        keras.layers.Conv2DTranspose(64, 4, strides=2, padding="same"), keras.layers.LeakyReLU(0.2),
        keras.layers.Conv2DTranspose(32, 4, strides=2, padding="same"), keras.layers.LeakyReLU(0.2),
        keras.layers.Conv2D(1, 5, padding="same", activation="sigmoid"),
    ])
    gan = GAN(discriminator, generator, LATENT)
    gan.compile(d_optimizer=keras.optimizers.Adam(1e-4), g_optimizer=keras.optimizers.Adam(1e-4),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    return gan


images = load_idx_dir("/usr/share/datasets/fashion-mnist").train_images[..., None].astype("float32") / 255.0
result = gpupar.fit(model_fn, images, batch_size=128, epochs=1 if quick else 2,
                    strategy="mirrored", virtual_cpus=2,  # two logical CPU devices stand in for two GPUs
                    steps_per_epoch=3 if quick else None, save=False)
print(f"{result.strategy_description.split(';')[0]}: d_loss {result.logs['d_loss']:.4f}, "
      f"g_loss {result.logs['g_loss']:.4f}")
