"""The end-to-end example of the guide "Making new layers and models via subclassing": a
subclassed VAE whose KL divergence is an `add_loss()` inside `call()`, added to a compiled MSE
loss and trained with Keras' own train_step, shrunk.

keras-io source: guides/keras_core/making_new_layers_and_models_via_subclassing.py at commit
979102fe166d2e5a4ada5e33d82c99a388eed2da (the Keras 3 version of the guide, "Last modified:
2023/06/25", written for `keras_core`; `import keras_core as keras` / `from keras_core import
ops, layers` are written `keras` here, which is the same API under its released name). Only the
guide's closing section is ported: Sampling, Encoder, Decoder, VariationalAutoEncoder, the MNIST
preparation, compile and fit; the small demonstrations before it (Linear, ComputeSum, ...) are
not part of that program.

Shrunk: 512 synthetic MNIST digits (uint8, as keras.datasets.mnist.load_data returns them)
instead of 60,000, prepared as the guide does (reshape to (N, 784), float32 / 255; the guide
writes `reshape(60000, 784)`, here `reshape(len(x_train), 784)`). The model is kept at the
guide's sizes (VariationalAutoEncoder(784, 64, 32)), which are already small. Same compile
(Adam(learning_rate=1e-3), loss=MeanSquaredError()) and fit keywords (x, x, epochs=2,
batch_size=64). The guide evaluates nothing, so the history holds only `loss`.

Cause exercised: a model whose loss comes partly from `self.add_loss()` in `call()` (the KL
term, summed by Keras into the compiled loss), and an unseeded `keras.random.normal` in the
Sampling layer (Keras' global SeedGenerator).

Keras' own fit under MirroredStrategy fails for this program as written: the unseeded
`keras.random.normal` makes Keras' global SeedGenerator, a thread-local, inside each replica's
thread during the traced step (see README.md).

Entry points: `model_fn()` + `train(fit, workdir)` (one model, one fit) and
`script(strategy, fit, workdir)`.
"""

import numpy as np
import keras
from keras import layers
from keras import ops

from ._synthetic import mnist_digits

QUICK = True


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim))
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class Encoder(layers.Layer):
    """Maps MNIST digits to a triplet (z_mean, z_log_var, z)."""

    def __init__(self, latent_dim=32, intermediate_dim=64, name="encoder", **kwargs):
        super().__init__(name=name, **kwargs)
        self.dense_proj = layers.Dense(intermediate_dim, activation="relu")
        self.dense_mean = layers.Dense(latent_dim)
        self.dense_log_var = layers.Dense(latent_dim)
        self.sampling = Sampling()

    def call(self, inputs):
        x = self.dense_proj(inputs)
        z_mean = self.dense_mean(x)
        z_log_var = self.dense_log_var(x)
        z = self.sampling((z_mean, z_log_var))
        return z_mean, z_log_var, z


class Decoder(layers.Layer):
    """Converts z, the encoded digit vector, back into a readable digit."""

    def __init__(self, original_dim, intermediate_dim=64, name="decoder", **kwargs):
        super().__init__(name=name, **kwargs)
        self.dense_proj = layers.Dense(intermediate_dim, activation="relu")
        self.dense_output = layers.Dense(original_dim, activation="sigmoid")

    def call(self, inputs):
        x = self.dense_proj(inputs)
        return self.dense_output(x)


class VariationalAutoEncoder(keras.Model):
    """Combines the encoder and decoder into an end-to-end model for training."""

    def __init__(
        self,
        original_dim,
        intermediate_dim=64,
        latent_dim=32,
        name="autoencoder",
        **kwargs
    ):
        super().__init__(name=name, **kwargs)
        self.original_dim = original_dim
        self.encoder = Encoder(latent_dim=latent_dim, intermediate_dim=intermediate_dim)
        self.decoder = Decoder(original_dim, intermediate_dim=intermediate_dim)

    def call(self, inputs):
        z_mean, z_log_var, z = self.encoder(inputs)
        reconstructed = self.decoder(z)
        # Add KL divergence regularization loss.
        kl_loss = -0.5 * ops.mean(
            z_log_var - ops.square(z_mean) - ops.exp(z_log_var) + 1
        )
        self.add_loss(kl_loss)
        return reconstructed


def _x_train():
    # (x_train, _), _ = keras.datasets.mnist.load_data() in keras-io: 60,000 digits.
    x_train, _ = mnist_digits(512, np.random.default_rng(0))
    return x_train.reshape(len(x_train), 784).astype("float32") / 255  # reshape(60000, 784) in keras-io


def model_fn():
    # From keras-io, unchanged.
    vae = VariationalAutoEncoder(784, 64, 32)

    optimizer = keras.optimizers.Adam(learning_rate=1e-3)
    vae.compile(optimizer, loss=keras.losses.MeanSquaredError())
    return vae


def train(fit, workdir):
    x_train = _x_train()
    return fit(x_train, x_train, epochs=2, batch_size=64)


def script(strategy, fit, workdir):
    """The guide's program; what makes variables is in strategy.scope(), vae.fit(...) is fit(vae, ...)."""
    x_train = _x_train()
    with strategy.scope():
        vae = model_fn()
    return fit(vae, x_train, x_train, epochs=2, batch_size=64)
