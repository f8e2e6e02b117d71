"""Knowledge distillation (a Distiller model that overrides train_step and test_step), shrunk.

keras-io source: examples/vision/knowledge_distillation.py at commit
501fb4cbe62e5b5c434393f512a452ef833640a1: the tf.keras version whose Distiller overrides
compile(optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha, temperature),
train_step (teacher forward pass, student step with tf.GradientTape, distillation loss scaled
by temperature**2, self.compiled_metrics.update_state) and test_step. The current keras-io
version ("Converted to Keras 3 by Md Awsafur Rahman") overrides compile, compute_loss and call
instead; this port keeps the train_step/test_step version, with `keras` imports in place of
`tensorflow.keras` (see README.md).

Shrunk: 384 synthetic 28x28 uint8 digits with uint8 labels (what keras.datasets.mnist.load_data
returns; each class a blob at its own place) instead of MNIST's 60,000, prepared as in the
example (/255 to float32, reshape to (-1, 28, 28, 1)); teacher Conv2D 256/512 -> 32/64, student
Conv2D 16/32 -> 8/16; the teacher's own fit 5 epochs -> 2 (done once, in a cached helper, see
below); the distiller's fit 3 epochs -> 2. Same Distiller, compile arguments (Adam(),
SparseCategoricalAccuracy, SparseCategoricalCrossentropy(from_logits=True), KLDivergence(),
alpha=0.1, temperature=10) and fit call (x, y, epochs).

The teacher is trained as in the example (compile, then fit on the training digits) by a cached
helper, once per process, on first use; model_fn() builds a fresh teacher, loads those trained
weights, and builds a fresh student and Distiller around it. train() calls the helper before
fit, so the teacher's training happens outside any distribution scope unless model_fn() is
called first inside one.
"""

import functools

import numpy as np
import keras
import tensorflow as tf
from keras import layers

QUICK = True

num_classes = 10


class Distiller(keras.Model):
    # From keras-io examples/vision/knowledge_distillation.py @ 501fb4c, unchanged.
    def __init__(self, student, teacher):
        super(Distiller, self).__init__()
        self.teacher = teacher
        self.student = student

    def compile(
        self,
        optimizer,
        metrics,
        student_loss_fn,
        distillation_loss_fn,
        alpha=0.1,
        temperature=3,
    ):
        """Configure the distiller.

        Args:
            optimizer: Keras optimizer for the student weights
            metrics: Keras metrics for evaluation
            student_loss_fn: Loss function of difference between student
                predictions and ground-truth
            distillation_loss_fn: Loss function of difference between soft
                student predictions and soft teacher predictions
            alpha: weight to student_loss_fn and 1-alpha to distillation_loss_fn
            temperature: Temperature for softening probability distributions.
                Larger temperature gives softer distributions.
        """
        super(Distiller, self).compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def train_step(self, data):
        # Unpack data
        x, y = data

        # Forward pass of teacher
        teacher_predictions = self.teacher(x, training=False)

        with tf.GradientTape() as tape:
            # Forward pass of student
            student_predictions = self.student(x, training=True)

            # Compute losses
            student_loss = self.student_loss_fn(y, student_predictions)

            # Compute scaled distillation loss from https://arxiv.org/abs/1503.02531
            # The magnitudes of the gradients produced by the soft targets scale
            # as 1/T^2, multiply them by T^2 when using both hard and soft targets.
            distillation_loss = (
                self.distillation_loss_fn(
                    tf.nn.softmax(teacher_predictions / self.temperature, axis=1),
                    tf.nn.softmax(student_predictions / self.temperature, axis=1),
                )
                * self.temperature**2
            )

            loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss

        # Compute gradients
        trainable_vars = self.student.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)

        # Update weights
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))

        # Update the metrics configured in `compile()`.
        self.compiled_metrics.update_state(y, student_predictions)

        # Return a dict of performance
        results = {m.name: m.result() for m in self.metrics}
        results.update(
            {"student_loss": student_loss, "distillation_loss": distillation_loss}
        )
        return results

    def test_step(self, data):
        # Unpack the data
        x, y = data

        # Compute predictions
        y_prediction = self.student(x, training=False)

        # Calculate the loss
        student_loss = self.student_loss_fn(y, y_prediction)

        # Update the metrics.
        self.compiled_metrics.update_state(y, y_prediction)

        # Return a dict of performance
        results = {m.name: m.result() for m in self.metrics}
        results.update({"student_loss": student_loss})
        return results


def _teacher():
    # From keras-io (filters shrunk).
    return keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(32, (3, 3), strides=(2, 2), padding="same"),  # 256 in keras-io
            layers.LeakyReLU(negative_slope=0.2),  # alpha=0.2 in keras-io (Keras 2 name)
            layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
            layers.Conv2D(64, (3, 3), strides=(2, 2), padding="same"),  # 512 in keras-io
            layers.Flatten(),
            layers.Dense(10),
        ],
        name="teacher",
    )


def _student():
    # From keras-io (filters shrunk).
    return keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),  # 16 in keras-io
            layers.LeakyReLU(negative_slope=0.2),  # alpha=0.2 in keras-io (Keras 2 name)
            layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
            layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),  # 32 in keras-io
            layers.Flatten(),
            layers.Dense(10),
        ],
        name="student",
    )


def _synthetic_mnist(n, rng):
    """uint8 (n, 28, 28) images and uint8 (n,) labels; each class a noisy blob at its own place."""
    y = rng.integers(0, num_classes, size=n).astype("uint8")
    yy, xx = np.mgrid[0:28, 0:28]
    x = rng.integers(0, 50, size=(n, 28, 28)).astype("float32")
    for i, label in enumerate(y):
        cy = 5 + 6 * (int(label) // 4) + rng.normal(0, 1)  # 3 rows x 4 columns of blob places
        cx = 5 + 6 * (int(label) % 4) + rng.normal(0, 1)
        x[i] += 200 * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 8.0)
    return np.clip(x, 0, 255).astype("uint8"), y


@functools.cache
def _training_data():
    """(x_train, y_train): synthetic digits prepared as in keras-io (the test split is left out)."""
    x_train, y_train = _synthetic_mnist(384, np.random.default_rng(0))  # MNIST: 60,000
    # Normalize data
    x_train = x_train.astype("float32") / 255.0
    x_train = np.reshape(x_train, (-1, 28, 28, 1))
    return x_train, y_train


@functools.cache
def _trained_teacher_weights():
    """The example's "Train the teacher" step, run once; returns the trained weights."""
    x_train, y_train = _training_data()
    teacher = _teacher()
    # Train teacher as usual
    teacher.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    teacher.fit(x_train, y_train, epochs=2, verbose=0)  # epochs=5 (and progress bars) in keras-io
    return teacher.get_weights()


def model_fn():
    teacher = _teacher()
    teacher.set_weights(_trained_teacher_weights())
    student = _student()

    # Initialize and compile distiller
    distiller = Distiller(student=student, teacher=teacher)
    distiller.compile(
        optimizer=keras.optimizers.Adam(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=keras.losses.KLDivergence(),
        alpha=0.1,
        temperature=10,
    )
    return distiller


def train(fit, workdir):
    x_train, y_train = _training_data()
    _trained_teacher_weights()  # train the teacher now, outside any distribution scope

    # Distill teacher to student
    return fit(x_train, y_train, epochs=2)  # epochs=3 in keras-io
