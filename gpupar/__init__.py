"""gpupar: train Keras models on every device a machine has, on tf.distribute.

    import gpupar
    result = gpupar.fit_mnist(dataset="fashion_mnist", data_dir="/usr/share/datasets/fashion-mnist")

Importing gpupar does not import TensorFlow; the names that need it load on first use, so a bad
option is reported before TensorFlow starts.
"""

import importlib
import logging
import sys

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
    "FitResult": "gpupar.training.result",
    "EpochRecord": "gpupar.training.result",
}

__all__ = ["Config", "DevicePlan", "GpuparError", "Plan", "StagePlan", "diagnose_mnist", "fit_mnist", "plan_devices",
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


def fit_mnist(config: Config = None, optimizer=None, **options):
    """Trains the MNIST ConvNet (or config.model) on this machine's devices.

    Args:
      config: A Config; None for the defaults.
      optimizer: A Keras optimizer instead of Adam(learning_rate), e.g. keras.optimizers.SGD(0.1).
      **options: Config fields, over `config`; an unknown one is an error.

    Returns:
      A FitResult: the trained model, the per-epoch history, the final test accuracy.

    Raises:
      GpuparError: a bad option (before TensorFlow starts) or input, a failed save, a non-finite loss.
      TrainingInterrupted: SIGINT or SIGTERM, after saving a checkpoint.
    """
    config = Config.from_options(config, **options)
    from gpupar.training.run import train_and_evaluate

    return train_and_evaluate(config, optimizer)


def diagnose_mnist(config: Config = None, steps: int = 30, **options):
    """Measures what bounds training under these options: the input pipeline or the step.

    Args:
      config: A Config; None for the defaults.
      steps: Timed steps in each of the three measurements.
      **options: Config fields, over `config`.

    Returns:
      A gpupar.monitor.diagnose.Report: the three rates, the verdict and what to change.

    Raises:
      GpuparError: a bad option or input.
    """
    config = Config.from_options(config, **options)
    from gpupar.monitor.diagnose import diagnose

    return diagnose(config, steps)
