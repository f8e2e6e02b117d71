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
from gpupar.devices import DevicePlan, plan_devices
from gpupar.errors import GpuparError
from gpupar.stages import StagePlan, plan_stages
from gpupar.strategy import Plan, plan_strategy

_LAZY = {
    "configure_devices": "gpupar.devices",
    "make_strategy": "gpupar.strategy",
    "build_strategy": "gpupar.strategy",
    "build_convnet": "gpupar.model",
    "build_lstm": "gpupar.model",
    "train_and_evaluate": "gpupar.train",
    "FitResult": "gpupar.result",
    "EpochRecord": "gpupar.result",
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


def fit_mnist(config: Config = None, **options):
    """Trains the MNIST ConvNet (or config.model) on this machine's devices and returns a FitResult.

    Pass a Config, keyword options (the Config field names), or both (options override).
    """
    config = Config.from_options(config, **options)
    from gpupar.train import train_and_evaluate

    return train_and_evaluate(config)


def diagnose_mnist(config: Config = None, steps: int = 30, **options):
    """Measures what bounds training under these options (input pipeline or step); returns a diagnose.Report.

    Takes the same Config or options as fit_mnist, and times `steps` steps in each measurement.
    """
    config = Config.from_options(config, **options)
    from gpupar.diagnose import diagnose

    return diagnose(config, steps)
