"""gpupar: train Keras models on every device a machine has, on tf.distribute.

>>> import gpupar, keras, numpy as np
>>> x, y = np.random.default_rng(0).normal(size=(64, 4)).astype("float32"), np.arange(64) % 2
>>> def model_fn():
...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
...     model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
...     return model
>>> result = gpupar.fit(model_fn, x, y, batch_size=16, epochs=2, validation_split=0.25, verbose=0, save=False)
>>> sorted(result.history), len(result.epoch)
(['accuracy', 'loss', 'val_accuracy', 'val_loss'], 2)

The MNIST presets: gpupar.fit_mnist(dataset="fashion_mnist", data_dir="/usr/share/datasets/fashion-mnist").
Importing gpupar does not import TensorFlow; the names that need it load on first use, so a bad
option is reported before TensorFlow starts.
"""

import importlib
import logging
import os
import sys

# CUDA numbers GPUs "fastest first" unless told otherwise, NVML in PCI bus order; with this
# default (set before TensorFlow starts CUDA) TensorFlow's GPU i is NVML's i-th visible GPU.
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")

from gpupar.versions import check_supported  # noqa: E402

check_supported()  # a TensorFlow or Keras outside pyproject's range is refused here, in one line, before any use

from gpupar.config import Config
from gpupar.errors import GpuparError
from gpupar.runtime.devices import DevicePlan, plan_devices
from gpupar.runtime.stages import StagePlan, plan_stages
from gpupar.runtime.strategy import Plan, plan_strategy

_LAZY = {
    "configure_devices": "gpupar.runtime.devices",
    "make_strategy": "gpupar.runtime.strategy",
    "build_strategy": "gpupar.runtime.strategy",
    "build_convnet": "gpupar.models.convnet",
    "build_lstm": "gpupar.models.lstm",
    "train_and_evaluate": "gpupar.training.run",
    "MnistOptions": "gpupar.presets.mnist_options",
    "TrainingInterrupted": "gpupar.training.interrupt",
    "FitResult": "gpupar.training.result",
    "EpochRecord": "gpupar.training.result",
    "global_mean": "gpupar.training.steps.own",
}

__all__ = ["Config", "DevicePlan", "GpuparError", "Plan", "StagePlan", "diagnose", "diagnose_mnist", "fit", "fit_mnist",
           "plan_devices", "plan_stages", "plan_strategy", "strategy", *_LAZY]


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is at the time, so redirections and test capture see it."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _):
        pass


_log = logging.getLogger("gpupar")
if not _log.handlers:
    _log.addHandler(_StdoutHandler())
    _log.setLevel(logging.INFO)
    _log.propagate = False


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpupar' has no attribute {name!r}")


def __dir__():
    """The module's names with the lazily imported ones, so dir() and completion show the whole API."""
    return sorted({*globals(), *_LAZY})


# model.fit's arguments that are Config fields, with Keras' defaults: given otherwise, they win over `config`.
_FIT_OPTIONS = {"batch_size": None, "epochs": 1, "verbose": "auto", "shuffle": True, "initial_epoch": 0,
                "steps_per_epoch": None, "validation_steps": None, "validation_batch_size": None, "validation_freq": 1}
# Names gpupar.fit took before it took model.fit's arguments.
_RENAMED = {"train_data": "x (and y)", "eval_data": "validation_data"}


def _fit_config(config, options) -> Config:
    """The Config of gpupar.fit: the options over `config` (or the process strategy's), none of them an MNIST
    preset's or a renamed one."""
    from gpupar.presets.mnist_options import OPTION_NAMES
    from gpupar.training.process import process_config

    for name in options:
        if name in _RENAMED:
            raise GpuparError(f"{name} is now {_RENAMED[name]}, as in model.fit: gpupar.fit(model, x, y, "
                              "validation_data=(x_val, y_val), ...)")
        if name in OPTION_NAMES:
            raise GpuparError(f"{name} is an option of the MNIST presets (gpupar.fit_mnist); gpupar.fit trains your "
                              "model on your data: build those into your model and x"
                              + (" (stop early with stop_at={'val_accuracy': ...})" if name == "stop_at_accuracy"
                                 else ""))
    return Config.from_options(process_config(config), **options)


def _fit_run(model, data, loss, metrics, optimizer, callbacks, config, fit_options, options):
    """(Config, Task, the checked mode) of gpupar.fit's or gpupar.diagnose's arguments, every check that needs no
    TensorFlow done."""
    given = {name: value for name, value in fit_options.items() if value != _FIT_OPTIONS[name]}
    config = _fit_config(config, {**options, **given})
    from gpupar.data.adapters import fit_data
    from gpupar.training import modes
    from gpupar.training.task import user_task

    mode = modes.checked(config)
    train, validation = fit_data(**data)
    return config, user_task(model, train, validation, loss, metrics, optimizer, callbacks or (),
                             raw=(data["x"], data["validation_data"]), seeded="seed" in options), mode


def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None, validation_split=0.0,
        validation_data=None, shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
        steps_per_epoch=None, validation_steps=None, validation_batch_size=None, validation_freq=1, *, loss=None,
        metrics=None, optimizer=None, config: Config = None, **options):
    """Trains a Keras model as model.fit would, on every device the options (or gpupar.strategy) pick.

    A script written to Keras' multi-GPU guide ports by two renames: `tf.distribute.MirroredStrategy()`
    becomes `gpupar.strategy("mirrored")` (its `with strategy.scope():` blocks stay), and
    `model.fit(` becomes `gpupar.fit(model, `: every argument after the model means what it means
    in model.fit, and fitting the same model again continues its training.

    Args:
      model: A built, compiled keras.Model, or a function of no arguments that returns one
        (model_fn: gpupar calls it under the strategy's scope). A model built under
        gpupar.strategy(...) trains as it is, its optimizer's state kept from fit to fit; one built
        outside any strategy trains as it is on one device, and is rebuilt under the strategy
        (from its config, weights and compile arguments) for several, its trained weights copied
        back at the end.
      x, y, batch_size, epochs, verbose, callbacks, validation_split, validation_data, shuffle,
        class_weight, sample_weight, initial_epoch, steps_per_epoch, validation_steps,
        validation_batch_size, validation_freq: As model.fit's. x may also be a
        dataset_fn(input_context) of per-replica batches or a TFDS name ("tfds:cifar10").
        batch_size is the global batch, split over the replicas (per_replica_batch_size= asks for
        a batch per replica instead).
      loss, metrics, optimizer: For a model that comes uncompiled: as model.compile's
        (optimizer None: Adam(learning_rate)). A Keras optimizer or metric object made before the
        call has started TensorFlow: where device options must still apply, call
        gpupar.strategy(...) (or gpupar.configure_devices(...)) first thing in the script.
      config: gpupar's options as a Config; None for the defaults (those of gpupar.strategy(...),
        where the process made one).
      **options: gpupar's options (Config fields) over `config`: strategy, virtual_cpus,
        model_dir, resume, accumulate_steps, precision, nan_policy, seed, ...

    Returns:
      A FitResult, usable where Keras' History is: .history ({"loss": [...], "val_loss": [...]}),
      .epoch, .model (compiled, usable without entering a scope); with gpupar's records per epoch
      (.records), the final logs and .save(path).

    Raises:
      GpuparError: a bad option or input, before any training step and with nothing written; a
        failed save; a non-finite loss (the last good checkpoint is kept).
      TrainingInterrupted: SIGINT or SIGTERM, after saving a checkpoint.
    """
    from gpupar.training.run import train_and_evaluate

    data = dict(x=x, y=y, sample_weight=sample_weight, class_weight=class_weight, validation_split=validation_split,
                validation_data=validation_data)
    fit_options = dict(batch_size=batch_size, epochs=epochs, verbose=verbose, shuffle=shuffle,
                       initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                       validation_batch_size=validation_batch_size, validation_freq=validation_freq)
    return train_and_evaluate(*_fit_run(model, data, loss, metrics, optimizer, callbacks, config, fit_options,
                                        options))


def strategy(kind: str = "auto", **options):
    """The process's tf.distribute.Strategy, made once: what Keras' multi-GPU guide makes at the top of a script.

    It configures the devices (or joins the cluster) first, so it is the script's first
    TensorFlow line; it uses logical devices the script configured itself. Every later
    gpupar.fit takes its options as defaults and, with them, this very object: a model built
    under `with strategy.scope():` trains through gpupar.fit(model, ...) as it is.

    Args:
      kind: auto, one_device, mirrored, central_storage, multi_worker_mirrored or parameter_server.
      **options: Device options (virtual_cpus, gpus, memory_growth, memory_limit_mb, ...) and the
        strategy's (devices, cross_device_ops, ps_shards, slurm_ps).

    Returns:
      The tf.distribute.Strategy, the same object for the same options for the rest of the
      process. On a parameter-server cluster's ps and worker tasks it serves and never returns.

    Raises:
      GpuparError: a bad option, a kind the devices or the cluster cannot run, or device settings
        that TensorFlow, already started, can no longer make.
    """
    from gpupar.training.process import process_strategy

    return process_strategy(kind, **options)


def fit_mnist(config: Config = None, optimizer=None, callbacks=(), preset=None, **options):
    """Trains the MNIST ConvNet (or preset.model) on (Fashion-)MNIST: gpupar.fit with a preset model and data.

    Args:
      config: A Config; None for the defaults.
      optimizer: A Keras optimizer instead of Adam(learning_rate), e.g. keras.optimizers.SGD(0.1).
      callbacks: keras.callbacks.Callback objects.
      preset: The preset's options (gpupar.MnistOptions: dataset, data_dir, model, ...); None for the defaults.
      **options: Config fields over `config`, and MnistOptions fields over `preset`; an unknown one is an error.

    Returns:
      A FitResult: the trained model, the per-epoch history, the final logs (test_accuracy is val_accuracy).

    Raises:
      GpuparError: a bad option (before TensorFlow starts) or input, a failed save, a non-finite loss.
      TrainingInterrupted: SIGINT or SIGTERM, after saving a checkpoint.
    """
    from gpupar.presets.mnist import mnist_run
    from gpupar.presets.mnist_options import mnist_options
    from gpupar.training.run import train_and_evaluate

    return train_and_evaluate(*mnist_run(*mnist_options(config, preset, options), optimizer, callbacks))


def diagnose(model, x=None, y=None, batch_size=None, sample_weight=None, *, loss=None, metrics=None,
             optimizer=None, config: Config = None, steps: int = 30, **options):
    """Measures what bounds training of your model on your data: the input pipeline or the step.

    Args:
      model, x, y, batch_size, sample_weight, loss, metrics, optimizer, config, **options: as gpupar.fit's. A
        built model takes the measured steps as training would (its weights move): pass a model_fn to
        measure on fresh copies.
      steps: Timed steps in each of the three measurements.

    Returns:
      A gpupar.commands.diagnose.Report: the three rates, the verdict and what to change.

    Raises:
      GpuparError: a bad option or input.
    """
    from gpupar.commands.diagnose import diagnose as measure

    data = dict(x=x, y=y, sample_weight=sample_weight, class_weight=None, validation_split=0.0, validation_data=None)
    return measure(*_fit_run(model, data, loss, metrics, optimizer, (), config, {"batch_size": batch_size},
                             options), steps)


def diagnose_mnist(config: Config = None, steps: int = 30, preset=None, **options):
    """Measures what bounds training of an MNIST preset under these options: the input pipeline or the step.

    Args:
      config: A Config; None for the defaults.
      steps: Timed steps in each of the three measurements.
      preset: The preset's options (gpupar.MnistOptions); None for the defaults.
      **options: Config fields over `config`, and MnistOptions fields over `preset`.

    Returns:
      A gpupar.commands.diagnose.Report: the three rates, the verdict and what to change.

    Raises:
      GpuparError: a bad option or input.
    """
    from gpupar.commands.diagnose import diagnose as measure
    from gpupar.presets.mnist import mnist_run
    from gpupar.presets.mnist_options import mnist_options

    return measure(*mnist_run(*mnist_options(config, preset, options)), steps)
