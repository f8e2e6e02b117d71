"""gpupar: train Keras models on every device a machine has, on tf.distribute.

    import gpupar, keras
    result = gpupar.fit(lambda: keras.Sequential([...]), (x, y), eval_data=(x_test, y_test), strategy="mirrored")
    result = gpupar.fit_mnist(dataset="fashion_mnist", data_dir="/usr/share/datasets/fashion-mnist")

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
    "global_mean": "gpupar.training.own_step",
}

__all__ = ["Config", "DevicePlan", "GpuparError", "Plan", "StagePlan", "diagnose", "diagnose_mnist", "fit", "fit_mnist",
           "plan_devices",
           "plan_stages", "plan_strategy", *_LAZY]


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
    """The Config of gpupar.fit: the options over `config`, none of them an MNIST preset's or a renamed one."""
    from gpupar.presets.mnist_options import OPTION_NAMES

    for name in options:
        if name in _RENAMED:
            raise GpuparError(f"{name} is now {_RENAMED[name]}, as in model.fit: gpupar.fit(model_fn, x, y, "
                              "validation_data=(x_val, y_val), ...)")
        if name in OPTION_NAMES:
            raise GpuparError(f"{name} is an option of the MNIST presets (gpupar.fit_mnist); gpupar.fit trains your "
                              "model on your data: build those into model_fn and x"
                              + (" (stop early with stop_at={'val_accuracy': ...})" if name == "stop_at_accuracy"
                                 else ""))
    return Config.from_options(config, **options)


def _fit_run(model_fn, data, loss, metrics, optimizer, callbacks, config, fit_options, options):
    """(Config, Task) of gpupar.fit's or gpupar.diagnose's arguments, every check that needs no TensorFlow done."""
    given = {name: value for name, value in fit_options.items() if value != _FIT_OPTIONS[name]}
    config = _fit_config(config, {**options, **given})
    from gpupar.data.adapters import fit_data
    from gpupar.training.task import user_task

    train, validation = fit_data(**data)
    return config, user_task(model_fn, train, validation, loss, metrics, optimizer, callbacks or (),
                             raw=(data["x"], data["validation_data"]))


def fit(model_fn, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None, validation_split=0.0,
        validation_data=None, shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
        steps_per_epoch=None, validation_steps=None, validation_batch_size=None, validation_freq=1, *, loss=None,
        metrics=None, optimizer=None, config: Config = None, **options):
    """Trains the Keras model that model_fn builds, as model.fit would, on every device the options pick.

    A Keras script ports by moving the model's build and compile into model_fn and calling
    gpupar.fit(model_fn, ...) where it called model.fit(...): every argument after model_fn means
    what it means in model.fit.

    Args:
      model_fn: A function of no arguments that returns a keras.Model (Sequential, functional or
        subclassed; any number of inputs and outputs), compiled or not. gpupar calls it under the
        strategy's scope; a compiled model trains with its compile() arguments.
      x, y, batch_size, epochs, verbose, callbacks, validation_split, validation_data, shuffle,
        class_weight, sample_weight, initial_epoch, steps_per_epoch, validation_steps,
        validation_batch_size, validation_freq: As model.fit's. x may also be a
        dataset_fn(input_context) of per-replica batches or a TFDS name ("tfds:cifar10").
        batch_size is the global batch, split over the replicas (per_replica_batch_size= asks for
        a batch per replica instead).
      loss, metrics, optimizer: For a model that model_fn does not compile: as model.compile's
        (optimizer None: Adam(learning_rate)). A Keras optimizer or metric object made before the
        call has started TensorFlow: where device options must still apply, call
        gpupar.configure_devices(...) first thing in the script.
      config: gpupar's options as a Config; None for the defaults.
      **options: gpupar's options (Config fields) over `config`: strategy, virtual_cpus,
        model_dir, resume, accumulate_steps, precision, nan_policy, ...

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
    return train_and_evaluate(*_fit_run(model_fn, data, loss, metrics, optimizer, callbacks, config, fit_options,
                                        options))


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


def diagnose(model_fn, x=None, y=None, batch_size=None, sample_weight=None, *, loss=None, metrics=None,
             optimizer=None, config: Config = None, steps: int = 30, **options):
    """Measures what bounds training of your model on your data: the input pipeline or the step.

    Args:
      model_fn, x, y, batch_size, sample_weight, loss, metrics, optimizer, config, **options: as gpupar.fit's.
      steps: Timed steps in each of the three measurements.

    Returns:
      A gpupar.commands.diagnose.Report: the three rates, the verdict and what to change.

    Raises:
      GpuparError: a bad option or input.
    """
    from gpupar.commands.diagnose import diagnose as measure

    data = dict(x=x, y=y, sample_weight=sample_weight, class_weight=None, validation_split=0.0, validation_data=None)
    return measure(*_fit_run(model_fn, data, loss, metrics, optimizer, (), config, {"batch_size": batch_size},
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
