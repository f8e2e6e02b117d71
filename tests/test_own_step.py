"""Models with their own train_step (GANs, distillation, VAEs) through gpupar.fit: 2 replicas, exact resume, refusals.

Each model kind runs on 2 replicas, is stopped mid-epoch at a step checkpoint and resumed, and
must end with the weights (and the epoch's logs) of an uninterrupted run. SGD where a scale
error would show: a distillation step on 2 replicas must update as on one device.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import gpupar
from gpupar.errors import GpuparError

ATOL = 1e-5


def _images(num=256, seed=0):
    return np.random.default_rng(seed).normal(size=(num, 6)).astype("float32")


def _labelled(num=256, seed=0):
    x = _images(num, seed)
    return x, np.argmax(x[:, :4], axis=1).astype("int32")


class GAN(keras.Model):
    """A DCGAN's shape: generator and discriminator, two optimizers, alternating updates, noise from a SeedGenerator."""

    def __init__(self, latent=3):
        super().__init__()
        self.latent = latent
        self.discriminator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                               keras.layers.Dense(1)])
        self.generator = keras.Sequential([keras.Input((latent,)), keras.layers.Dense(6)])
        self.seed_generator = keras.random.SeedGenerator(7)
        self.d_loss_tracker, self.g_loss_tracker = keras.metrics.Mean(name="d_loss"), keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def noise(self, shape):
        """Latent vectors, from the model's SeedGenerator (whose state checkpoints hold)."""
        return keras.random.normal(shape, seed=self.seed_generator)

    def train_step(self, real):
        batch = tf.shape(real)[0]
        noise = self.noise((batch, self.latent))
        fake = self.generator(noise)
        labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(tf.concat([real, fake], axis=0)))
        weights = self.discriminator.trainable_weights
        self.d_optimizer.apply_gradients(zip(tape.gradient(d_loss, weights), weights))
        noise = self.noise((batch, self.latent))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.ones((batch, 1)), self.discriminator(self.generator(noise)))
        weights = self.generator.trainable_weights
        self.g_optimizer.apply_gradients(zip(tape.gradient(g_loss, weights), weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


class UnseededGAN(GAN):
    """The GAN drawing with tf.random.normal: the same draws every run, but where the op got to is in no checkpoint."""

    def noise(self, shape):
        return tf.random.normal(shape)


class GlobalGeneratorGAN(GAN):
    """The GAN drawing from TensorFlow's global generator."""

    def noise(self, shape):
        return tf.random.get_global_generator().normal(shape)


def gan_fn(learning_rate=0.05, kind=GAN):
    keras.utils.set_random_seed(1)
    model = kind()
    model.compile(keras.optimizers.SGD(learning_rate), keras.optimizers.SGD(learning_rate),
                  keras.losses.BinaryCrossentropy(from_logits=True))
    return model


class Distiller(keras.Model):
    """Knowledge distillation's shape: a frozen teacher inside, a student trained on a mixed loss, its own test_step."""

    def __init__(self, teacher, student):
        super().__init__()
        self.teacher, self.student = teacher, student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.5, temperature=2.0):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
        self.alpha, self.temperature = alpha, temperature

    def call(self, x):
        return self.student(x)

    def train_step(self, data):
        x, y = data
        teacher_predictions = self.teacher(x, training=False)
        with tf.GradientTape() as tape:
            student_predictions = self.student(x, training=True)
            student_loss = self.student_loss_fn(y, student_predictions)
            distillation_loss = self.distillation_loss_fn(
                tf.nn.softmax(teacher_predictions / self.temperature, axis=1),
                tf.nn.softmax(student_predictions / self.temperature, axis=1)) * self.temperature ** 2
            loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        weights = self.student.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        for metric in self.metrics:
            if metric.name != "loss":
                metric.update_state(y, student_predictions)
        return {"student_loss": student_loss, "distillation_loss": distillation_loss,
                **{m.name: m.result() for m in self.metrics if m.name != "loss"}}

    def test_step(self, data):
        x, y = data
        predictions = self.student(x, training=False)
        for metric in self.metrics:
            if metric.name != "loss":
                metric.update_state(y, predictions)
        return {"student_loss": self.student_loss_fn(y, predictions),
                **{m.name: m.result() for m in self.metrics if m.name != "loss"}}


def distiller_fn():
    keras.utils.set_random_seed(1)
    teacher = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
    teacher.trainable = False
    student = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(4)])
    model = Distiller(teacher, student)
    model.compile(keras.optimizers.SGD(0.1), [keras.metrics.SparseCategoricalAccuracy()],
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), keras.losses.KLDivergence(),
                  alpha=0.3, temperature=3.0)
    return model


class Sampling(keras.layers.Layer):
    """z = mean + exp(log_var / 2) * noise, adding the KL divergence with add_loss."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(3)

    def call(self, inputs):
        mean, log_var = inputs
        kl = -0.5 * tf.reduce_mean(tf.reduce_sum(1 + log_var - tf.square(mean) - tf.exp(log_var), axis=1))
        self.add_loss(kl)
        return mean + tf.exp(0.5 * log_var) * keras.random.normal(tf.shape(mean), seed=self.seed_generator)


class VAE(keras.Model):
    """A VAE's shape: an encoder with a sampling layer whose KL term comes from add_loss, a decoder."""

    def __init__(self):
        super().__init__()
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        mean, log_var = keras.layers.Dense(2)(hidden), keras.layers.Dense(2)(hidden)
        self.encoder = keras.Model(inputs, Sampling()([mean, log_var]))
        self.decoder = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="relu"),
                                         keras.layers.Dense(6)])
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker]

    def call(self, x):
        return self.decoder(self.encoder(x))

    def train_step(self, data):
        with tf.GradientTape() as tape:
            reconstruction = self.decoder(self.encoder(data))
            loss = gpupar.global_mean(tf.reduce_sum(tf.square(data - reconstruction), axis=1)) + tf.add_n(
                self.encoder.losses) / tf.distribute.get_strategy().num_replicas_in_sync
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_weights), self.trainable_weights))
        self.total_loss_tracker.update_state(loss)
        return {"total_loss": self.total_loss_tracker.result()}


def vae_fn():
    keras.utils.set_random_seed(1)
    model = VAE()
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


def _fit(model_fn, x, y=None, replicas=2, **options):
    placement = dict(strategy="mirrored", virtual_cpus=2) if replicas == 2 else dict(strategy="one_device")
    settings = dict(batch_size=32, epochs=2, save=False, verbose=0)
    settings.update(options)
    return gpupar.fit(model_fn, x, y, **placement, **settings)


def _difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.model.get_weights(), b.model.get_weights()))


def _straight_and_resumed(model_fn, data, model_dir, **options):
    """An uninterrupted run, and the same run stopped at step 6 of its first epoch (a step checkpoint) and resumed."""
    straight = _fit(model_fn, *data, **options)
    _fit(model_fn, *data, save=True, model_dir=model_dir, checkpoint_every_steps=3, **{**options, "epochs": 1})
    resumed = _fit(model_fn, *data, save=True, model_dir=model_dir,
                   resume=os.path.join(model_dir, "within_epoch", "step-6"), **options)
    return straight, resumed


def _moved(result, model_fn):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(result.model.get_weights(), model_fn().get_weights()))


KINDS = {"gan": (gan_fn, lambda: (_images(),), {"d_loss", "g_loss"}),
         "distillation": (distiller_fn, _labelled, {"student_loss", "distillation_loss", "sparse_categorical_accuracy"}),
         "vae": (vae_fn, lambda: (_images(),), {"total_loss"})}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_own_train_step_on_two_replicas_resumed_mid_epoch_ends_as_an_uninterrupted_run(kind, tmp_path):
    model_fn, data, names = KINDS[kind]
    straight, resumed = _straight_and_resumed(model_fn, data(), str(tmp_path / "run"))
    assert resumed.replicas == 2 and resumed.records[0].resumed_at_step == 6
    assert _moved(straight, model_fn) > 100 * ATOL
    assert _difference(straight, resumed) < 1e-6
    # The resumed epoch reports the whole epoch: the step's metrics were in the checkpoint.
    assert set(straight.history) == names  # the logs are what the step returns, under its names
    for name, values in straight.history.items():
        assert resumed.history[name] == values, name


def test_without_its_metrics_in_the_checkpoint_a_resumed_epoch_reports_only_its_own_steps(tmp_path, monkeypatch):
    """The control of the test above: the step's metrics are what carries the epoch's logs over a restart."""
    from gpupar.training import checkpoint

    original = checkpoint.Checkpoints.__init__
    monkeypatch.setattr(checkpoint.Checkpoints, "__init__", lambda self, model_dir, state, *args: original(
        self, model_dir, {name: value for name, value in state.items() if name != "step_state"}, *args))
    straight, resumed = _straight_and_resumed(gan_fn, (_images(),), str(tmp_path / "run"))
    assert _difference(straight, resumed) < 1e-6  # the weights do not depend on the metrics...
    assert abs(resumed.history["d_loss"][0] - straight.history["d_loss"][1]) > 1e-4  # ...the epoch's logs do


def test_a_resumed_epoch_logs_to_the_last_bit_what_an_uninterrupted_one_does(tmp_path):
    """TensorFlow restores 1/2 of the metrics' sum on each replica; on these data the logs came out one float32
    step apart (0.41293656826019287 against 0.4129365384578705) until each replica's own value was put back."""
    straight, resumed = _straight_and_resumed(gan_fn, (_images(seed=3),), str(tmp_path / "run"), epochs=1)
    assert _difference(straight, resumed) == 0.0
    assert resumed.history == straight.history


def test_a_step_drawing_from_tensorflows_global_generator_resumes_exactly(tmp_path):
    def model_fn():
        # Made in the run's strategy scope, as a fresh process's first draw makes it; seeded, so that runs compare.
        tf.random.set_global_generator(tf.random.Generator.from_seed(5))
        return gan_fn(kind=GlobalGeneratorGAN)

    straight, resumed = _straight_and_resumed(model_fn, (_images(),), str(tmp_path / "run"))
    assert _moved(straight, model_fn) > 100 * ATOL
    assert _difference(straight, resumed) == 0.0


def test_a_step_drawing_with_tf_random_normal_says_once_before_training_that_a_resume_is_not_exact(caplog):
    caplog.set_level("INFO", "gpupar")

    def said():
        return [r.getMessage() for r in caplog.records if "draws with" in r.getMessage()]

    before_training = []
    note = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: before_training.append(said()))
    _fit(lambda: gan_fn(kind=UnseededGAN), _images(), epochs=1, callbacks=[note])
    (line,) = before_training[0]
    assert said() == [line] and line.startswith("resume: UnseededGAN.train_step draws with tf.random.normal, whose "
                                                "state no checkpoint can hold, so a resumed run will not draw what an "
                                                "uninterrupted one would; for an exact resume draw with keras.random.*")
    caplog.clear()
    _fit(gan_fn, _images(), epochs=1)  # draws from a SeedGenerator: nothing to say
    assert not said()


def test_a_distillation_step_on_two_replicas_updates_as_on_one_device():
    x, y = _labelled(250)  # a last batch of 26: 13 per replica
    one = _fit(distiller_fn, x, y, replicas=1, epochs=1)
    two = _fit(distiller_fn, x, y, epochs=1)
    assert _moved(one, distiller_fn) > 100 * ATOL
    assert _difference(one, two) < ATOL
    assert two.history["sparse_categorical_accuracy"] == pytest.approx(one.history["sparse_categorical_accuracy"])


def test_validation_data_runs_the_models_test_step():
    x, y = _labelled()
    result = _fit(distiller_fn, x, y, validation_data=_labelled(64, seed=5), epochs=1)
    assert set(result.logs) == {"student_loss", "distillation_loss", "sparse_categorical_accuracy", "val_student_loss",
                                "val_sparse_categorical_accuracy"}
    model = result.model  # Keras' own evaluate on the trained model gives the same accuracy
    keras_logs = model.evaluate(*_labelled(64, seed=5), batch_size=64, verbose=0, return_dict=True)
    keras_logs = {**keras_logs, **keras_logs.get("compile_metrics", {})}  # Keras 3.12 and before nest them there
    assert result.logs["val_sparse_categorical_accuracy"] == pytest.approx(
        float(keras_logs["sparse_categorical_accuracy"]), abs=1e-6)


class NoiseSpread(keras.Model):
    """Counts the distinct noise values drawn over the global batch, and trains one weight on them."""

    def __init__(self):
        super().__init__()
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")
        self.seed_generator = keras.random.SeedGenerator(5)
        self.norm = keras.layers.BatchNormalization()
        self.norm.build((None, 6))

    def train_step(self, data):
        noise = keras.random.uniform((tf.shape(data)[0], 1), seed=self.seed_generator)
        everyone = tf.distribute.get_replica_context().all_gather(noise, axis=0)
        with tf.GradientTape() as tape:
            loss = gpupar.global_mean(self.scale * noise[:, 0]) + 0.0 * tf.reduce_sum(self.norm(data, training=True))
        self.optimizer.apply_gradients([(tape.gradient(loss, self.scale), self.scale)])
        return {"distinct": tf.cast(tf.size(tf.unique(tf.reshape(everyone, [-1]))[0]), tf.float32)}


def test_random_draws_differ_per_replica_and_batch_norm_statistics_agree():
    def model_fn():
        model = NoiseSpread()
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        return model

    x = _images() * 3 + 1
    result = _fit(model_fn, x, epochs=1)
    assert result.history["distinct"] == [32.0]  # the replicas' 16 + 16 draws are all different
    moving = result.model.norm.moving_mean
    copies = [v.numpy() for v in moving.value.values]  # the MirroredVariable's copy on each replica
    assert len(copies) == 2 and np.allclose(copies[0], copies[1]) and abs(copies[0]).max() > 0.05


@pytest.mark.parametrize("options, message", [
    (dict(accumulate_steps=2), "GAN has its own train_step, which applies its own updates: accumulate_steps=2"),
    (dict(nan_policy="skip"), "GAN has its own train_step, which applies its own updates: nan_policy=skip"),
    (dict(precision="mixed_float16"), "GAN has its own train_step, whose optimizers do not scale the loss"),
    (dict(strategy="model_parallel", stages=("dense",), virtual_cpus=2),
     "GAN has its own train_step, which the model_parallel mode cannot run"),
])
def test_what_a_users_step_cannot_run_with_is_refused_in_one_line(options, message, tmp_path):
    model_dir = str(tmp_path / "run")
    with pytest.raises(GpuparError) as e:
        gpupar.fit(gan_fn, _images(), batch_size=32, save=True, model_dir=model_dir, verbose=0,
                   **{"strategy": "mirrored", "virtual_cpus": 2, **options})
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(os.path.join(model_dir, "checkpoint"))


class Broken(keras.Model):
    def __init__(self, returns):
        super().__init__()
        self.returns = returns
        self.dense = keras.layers.Dense(1)
        self.dense.build((None, 6))

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(self.dense(data) ** 2)
        if self.returns != "nothing updated":
            self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_weights), self.trainable_weights))
        return {"tuple": (loss, loss), "vector": {"loss": self.dense(data)[:, 0]}}.get(self.returns, {"loss": loss})


class OnlyTestStep(keras.Sequential):
    def test_step(self, data):
        return {}


@pytest.mark.parametrize("model_fn, message", [
    (lambda: Broken("tuple"), "Broken.train_step returned a tuple; return a dict of scalars"),
    (lambda: Broken("vector"), "Broken.train_step returned 'loss' of shape [16] and dtype float32"),  # a replica's
    (lambda: Broken("nothing updated"), "Broken.train_step updated no variable in its first steps"),
    (lambda: OnlyTestStep([keras.Input((6,)), keras.layers.Dense(1)]),
     "OnlyTestStep overrides test_step but not train_step"),
])
def test_a_bad_own_step_is_one_line_naming_the_class_before_any_checkpoint(model_fn, message, tmp_path):
    def compiled():
        model = model_fn()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    model_dir = str(tmp_path / "run")
    with pytest.raises(GpuparError) as e:
        _fit(compiled, _images(), save=True, model_dir=model_dir, checkpoint_every_steps=1)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(os.path.join(model_dir, "checkpoint"))


def test_a_non_finite_log_stops_training_and_keeps_the_last_checkpoint(tmp_path):
    x = _images()
    x[200:] = np.nan  # the last steps of the first epoch: after the step checkpoint at step 3
    model_dir = str(tmp_path / "run")
    with pytest.raises(GpuparError, match=r"training d_loss became nan at epoch 0, step 7; stopped without saving "
                                          r"\(the last good checkpoint .*step-6 is kept\)"):
        _fit(gan_fn, x, save=True, model_dir=model_dir, checkpoint_every_steps=3, steps_per_call=1, shuffle=False)
    assert {name.split(".")[0] for name in os.listdir(os.path.join(model_dir, "within_epoch"))} >= {"step-6"}


def test_diagnose_measures_a_models_own_step(monkeypatch):
    from gpupar.commands import diagnose
    from gpupar.runtime.precision import plan_precision

    monkeypatch.setattr(diagnose, "machine_precision", lambda gpus: plan_precision(("amx_bf16",)))
    report = gpupar.diagnose(gan_fn, _images(1024), batch_size=32, strategy="mirrored", virtual_cpus=2)
    assert report.global_batch == 32 and report.steps >= 4
    assert min(report.input_examples_per_second, report.step_examples_per_second,
               report.together_examples_per_second) > 0 and report.bound_by.startswith(("input pipeline", "train step"))
    # The GAN concatenates its float32 real images with the generator's bfloat16 ones: in bfloat16
    # it cannot run, and diagnose says so rather than failing.
    assert report.precisions["float32"]["examples_per_second"] > 0
    assert "bfloat16" in report.precisions["mixed_bfloat16"]["error"]
    assert "number format: mixed_bfloat16 fails on this model (" in report.format()
