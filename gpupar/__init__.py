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


def _fit_config(config, options) -> Config:
    """The Config of gpupar.fit: the options over `config`, none of them an MNIST preset's."""
    from gpupar.presets.mnist_options import OPTION_NAMES

    given = [name for name in options if name in OPTION_NAMES]
    if given:
        raise GpuparError(f"{given[0]} is an option of the MNIST presets (gpupar.fit_mnist); gpupar.fit trains your "
                          "model on your data: build those into model_fn and train_data"
                          + (" (stop early with stop_at={'val_accuracy': ...})" if given[0] == "stop_at_accuracy"
                             else ""))
    return Config.from_options(config, **options)


def fit(model_fn, train_data, eval_data=None, loss="sparse_categorical_crossentropy", metrics=("accuracy",),
        optimizer=None, callbacks=(), config: Config = None, **options):
    """Trains the Keras model that model_fn builds, on every device the options pick, and returns a FitResult.

    Args:
      model_fn: A function of no arguments that returns a keras.Model (Sequential, functional or
        subclassed; any number of inputs and outputs). gpupar calls it under the strategy's scope.
      train_data: (x, y) or (x, y, sample_weight) arrays (each part an array, or a dict or tuple of
        arrays); an unbatched tf.data.Dataset of the same structure; a dataset_fn(input_context)
        that returns per-replica batches; or a TFDS name such as "tfds:cifar10" (split "train").
      eval_data: The same forms, finite (a TFDS name's split is "test"); evaluated whole after
        every epoch. None: no evaluation.
      loss: A Keras loss name, a keras.losses.Loss, a function(y_true, y_pred) of one value per
        example, or one per output (dict or list). Averaged over the global batch as its reduction says.
      metrics: Keras metric names or keras.metrics.Metric objects (a dict or list of lists per output).
      optimizer: A Keras optimizer (schedules included), a function of no arguments that returns one,
        or its name; None: Adam(learning_rate). A Keras optimizer starts TensorFlow when it is made:
        where gpupar must set up devices or join a cluster first (virtual_cpus, GPU settings,
        several workers), pass the function, e.g. optimizer=lambda: keras.optimizers.SGD(0.1).
      callbacks: keras.callbacks.Callback objects, called as model.fit calls them.
      config: A Config; None for the defaults.
      **options: Config fields over `config` (strategy, batch_size per replica, epochs, model_dir,
        resume, stop_at, ...), but not the MNIST presets' (dataset, model, ...).

    Returns:
      A FitResult: the trained model, the per-epoch history (EpochRecord.logs: loss, <metric>,
      val_loss, val_<metric>) and the final logs; .save(path) writes a .keras file.

    Raises:
      GpuparError: a bad option or input, before any training step and with nothing written; a
        failed save; a non-finite loss (the last good checkpoint is kept).
      TrainingInterrupted: SIGINT or SIGTERM, after saving a checkpoint.
    """
    config = _fit_config(config, options)
    from gpupar.training.run import train_and_evaluate
    from gpupar.training.task import user_task

    return train_and_evaluate(config, user_task(model_fn, train_data, eval_data, loss, metrics, optimizer, callbacks))


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


def diagnose(model_fn, train_data, loss="sparse_categorical_crossentropy", metrics=("accuracy",), optimizer=None,
             config: Config = None, steps: int = 30, **options):
    """Measures what bounds training of your model on your data: the input pipeline or the step.

    Args:
      model_fn, train_data, loss, metrics, optimizer, config, **options: as gpupar.fit's.
      steps: Timed steps in each of the three measurements.

    Returns:
      A gpupar.commands.diagnose.Report: the three rates, the verdict and what to change.

    Raises:
      GpuparError: a bad option or input.
    """
    config = _fit_config(config, options)
    from gpupar.commands.diagnose import diagnose as measure
    from gpupar.training.task import user_task

    return measure(config, user_task(model_fn, train_data, None, loss, metrics, optimizer, ()), steps)


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
