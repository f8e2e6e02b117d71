"""Knowledge distillation, Keras 3 version (a Distiller that overrides compile, compute_loss and
call), with the teacher trained by fit first and then used inside the Distiller that is fit,
shrunk.

keras-io source: examples/vision/knowledge_distillation.py, the Keras 3 version ("Converted to
Keras 3 by: Md Awsafur Rahman", `import keras`, `from keras import ops`; `Distiller` overrides
`compile(optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha, temperature)`,
`compute_loss(x, y, y_pred, sample_weight, allow_empty)` (teacher forward pass, student loss,
distillation loss scaled by temperature**2) and `call(x)` (the student)). The stored snapshots
of keras-team/keras-io's file are all the older train_step/test_step version (latest
501fb4cbe62e5b5c434393f512a452ef833640a1, ported as `knowledge_distillation`); this text was read
from the search index's copy of the Keras 3 file (index file id 1631812810, which names no
repository or commit). See README.md.

Shrunk: 384 training and 128 test synthetic 28x28 uint8 digits with uint8 labels (what
keras.datasets.mnist.load_data returns; `_synthetic.mnist_digits`) instead of MNIST's
60,000 / 10,000, prepared as in the example (/255 to float32, reshape to (-1, 28, 28, 1));
teacher Conv2D 256/512 -> 32/64, student Conv2D 16/32 -> 8/16; teacher epochs 5 -> 2,
distiller epochs 3 -> 2. Same layers, compile arguments (Adam(), SparseCategoricalAccuracy,
SparseCategoricalCrossentropy(from_logits=True), KLDivergence(), alpha=0.1, temperature=10) and
fit calls (x, y, epochs; Keras' default batch size 32, the example's `batch_size = 64` is unused
by it, as in keras-io).

Deviations: the example evaluates after each fit (`teacher.evaluate(x_test, y_test)`,
`distiller.evaluate(x_test, y_test)`); here those evaluations are the fits'
`validation_data=(x_test, y_test)`, so that the histories hold val_ metrics. The closing
"Train student from scratch for comparison" (a clone of the student, compiled and fit on its
own) is left out, so that the last fit, whose history `script` returns, is the distiller's.

In this version the teacher is a trainable sub-model of the Distiller and the loss depends on its
output, so the distiller's fit updates the teacher's weights too (the train_step version only
applies gradients to the student's).

Causes exercised: a trained teacher reused (fit once as a model of its own, then called inside
another model's compute_loss while that model is fit); a model with its own compute_loss and
compile signature; several fits.

Entry point: `script(strategy, fit, workdir)` only: the program fits the teacher and then the
distiller that holds the trained teacher, which model_fn() + a single train(fit, workdir) can't
express.
"""

import numpy as np
import keras
from keras import layers
from keras import ops

from ._synthetic import mnist_digits

QUICK = True


class Distiller(keras.Model):
    # From keras-io (Keras 3 version), unchanged.
    def __init__(self, student, teacher):
        super().__init__()
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
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False
    ):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)

        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature**2)

        loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        return loss

    def call(self, x):
        return self.student(x)


def _data():
    # Prepare the train and test dataset.
    batch_size = 64  # unused by the example's fit calls, as in keras-io
    # keras.datasets.mnist.load_data() in keras-io (60,000 and 10,000 digits).
    rng = np.random.default_rng(0)
    (x_train, y_train), (x_test, y_test) = mnist_digits(384, rng), mnist_digits(128, rng)

    # Normalize data
    x_train = x_train.astype("float32") / 255.0
    x_train = np.reshape(x_train, (-1, 28, 28, 1))

    x_test = x_test.astype("float32") / 255.0
    x_test = np.reshape(x_test, (-1, 28, 28, 1))
    return x_train, y_train, x_test, y_test


def script(strategy, fit, workdir):
    """The example's program; what makes variables is in strategy.scope(), X.fit(...) is fit(X, ...)."""
    x_train, y_train, x_test, y_test = _data()

    with strategy.scope():
        # Create the teacher
        teacher = keras.Sequential(
            [
                keras.Input(shape=(28, 28, 1)),
                layers.Conv2D(32, (3, 3), strides=(2, 2), padding="same"),  # 256 in keras-io
                layers.LeakyReLU(negative_slope=0.2),
                layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
                layers.Conv2D(64, (3, 3), strides=(2, 2), padding="same"),  # 512 in keras-io
                layers.Flatten(),
                layers.Dense(10),
            ],
            name="teacher",
        )

        # Create the student
        student = keras.Sequential(
            [
                keras.Input(shape=(28, 28, 1)),
                layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),  # 16 in keras-io
                layers.LeakyReLU(negative_slope=0.2),
                layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
                layers.Conv2D(16, (3, 3), strides=(2, 2), padding="same"),  # 32 in keras-io
                layers.Flatten(),
                layers.Dense(10),
            ],
            name="student",
        )
        # (keras-io clones the student here for the from-scratch comparison, left out.)

        # Train teacher as usual
        teacher.compile(
            optimizer=keras.optimizers.Adam(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )

    # Train and evaluate teacher on data.
    # keras-io: teacher.fit(x_train, y_train, epochs=5); teacher.evaluate(x_test, y_test)
    fit(teacher, x_train, y_train, epochs=2, validation_data=(x_test, y_test))

    with strategy.scope():
        # Initialize and compile distiller
        distiller = Distiller(student=student, teacher=teacher)
        distiller.compile(
            optimizer=keras.optimizers.Adam(),
            metrics=[keras.metrics.SparseCategoricalAccuracy()],
            student_loss_fn=keras.losses.SparseCategoricalCrossentropy(
                from_logits=True
            ),
            distillation_loss_fn=keras.losses.KLDivergence(),
            alpha=0.1,
            temperature=10,
        )

    # Distill teacher to student
    # keras-io: distiller.fit(x_train, y_train, epochs=3); distiller.evaluate(x_test, y_test)
    return fit(distiller, x_train, y_train, epochs=2, validation_data=(x_test, y_test))
