"""The process's strategy: Keras' multi-GPU guide's `strategy`, made by gpupar, and the options every later fit shares.

    strategy = gpupar.strategy("mirrored")        # was: tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = make_model()
        model.compile(...)
    gpupar.fit(model, x, y, epochs=3)              # was: model.fit(x, y, epochs=3)

`process_strategy` configures the devices (or joins the cluster) first, as the first line of a
script must, and returns the strategy that every gpupar.fit of the process with the same options
uses (gpupar.runtime.strategy.shared_strategy); later fits take its options as their defaults.
"""

import logging
from typing import Optional

from gpupar.config import Config, DeviceSetup, Distribution
from gpupar.errors import GpuparError
from gpupar.runtime.cluster import detect_cluster
from gpupar.runtime.devices import configure_devices
from gpupar.training import modes

log = logging.getLogger("gpupar")
OPTIONS = tuple(DeviceSetup.field_names() + Distribution.field_names())
_DEFAULTS = {}  # the options of the process's strategy: the defaults of every later fit


def process_strategy(kind: str = "auto", **options):
    """Makes (once) and returns the process's strategy for `kind` and the device options; fits share it after.

    Raises:
      GpuparError: an unknown or bad option, a kind the devices or cluster cannot run, or device
        settings TensorFlow, already started, can no longer make.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise GpuparError(f"gpupar.strategy takes device and strategy options, not {', '.join(unknown)}; those are "
                          f"gpupar.fit's. Its options: {', '.join(OPTIONS)}")
    config = Config(strategy=kind, **options)
    cluster = detect_cluster(slurm_ps=config.distribution.slurm_ps)
    mode = modes.checked(config, cluster)
    if not mode.takes_built_model:
        raise GpuparError(f"strategy={mode.name} places the variables as it builds the model, so it has no strategy "
                          "to build under; pass a function that builds the model: gpupar.fit(model_fn, ...)")
    if mode.serves(cluster):
        mode.serve(config.device_setup, cluster)  # a ps or worker task of parameter servers: never returns
    configure_devices(config.device_setup)
    placement = mode.place(config.device_setup, cluster)
    _DEFAULTS.clear()
    _DEFAULTS.update(strategy=kind, **options)
    log.info(placement.description)
    return placement.strategy


def process_config(base: Optional[Config]) -> Optional[Config]:
    """`base`, or where it is None a Config of the process strategy's options (None before gpupar.strategy)."""
    if base is not None or not _DEFAULTS:
        return base
    return Config(**_DEFAULTS)
