"""The MNIST presets' own options, beside the Config: the data set, the model, augmentation, a target accuracy.

Importing this module does not import TensorFlow: the `gpupar` command makes its flags from it.
"""

import dataclasses
import os
from typing import Optional

from gpupar.config import Config, Options, boolean, choice, field_names, number, optional, quote, whole
from gpupar.errors import GpuparError

DATASETS = ("mnist", "fashion_mnist")
MODELS = ("convnet", "lstm")
AUGMENT_PLACEMENTS = ("device", "host")


@dataclasses.dataclass(frozen=True)
class MnistOptions(Options):
    """The MNIST presets' options: the data, the model, augmentation, a target accuracy.

    Attributes:
      dataset: TFDS dataset: mnist or fashion_mnist.
      data_dir: Folder with the four MNIST-format IDX files (gzipped or not); empty loads from TFDS.
      model: convnet, or lstm (stacked LSTM over the 28 image rows).
      dropout: Dropout rate before the last layer.
      sync_batch_norm: Batch-norm statistics over the global batch rather than each replica's.
      lstm_layers: LSTM layers of model=lstm; model_parallel puts each on its own device.
      lstm_units: Units in each LSTM layer of model=lstm.
      augment: Randomly shift, rotate and zoom the training images.
      augment_on: Where augmentation runs: device (in the train step, batched) or host (tf.data, per image).
      stop_at_accuracy: Stop after the first epoch whose test accuracy reaches this (e.g. 0.89); empty trains all epochs.
    """

    dataset: str = "mnist"
    data_dir: Optional[str] = None
    model: str = "convnet"
    dropout: float = 0.5
    sync_batch_norm: bool = False
    lstm_layers: int = 3
    lstm_units: int = 128
    augment: bool = False
    augment_on: str = "device"
    stop_at_accuracy: Optional[float] = None

    _rules = {"dataset": choice(DATASETS), "model": choice(MODELS),
              "dropout": number("a rate in [0, 1)", lambda v: 0 <= v < 1), "sync_batch_norm": boolean,
              "lstm_layers": whole(1), "lstm_units": whole(1), "augment": boolean,
              "augment_on": choice(AUGMENT_PLACEMENTS),
              "stop_at_accuracy": optional(number("an accuracy in (0, 1], e.g. 0.89", lambda v: 0 < v <= 1))}

    def _parse(self):
        if self.data_dir == "":
            self._set("data_dir", None)

    def _check(self):
        if self.data_dir is not None and not os.path.isdir(self.data_dir):
            raise GpuparError(f"data_dir={quote(self.data_dir)} does not exist or is not a folder; point it at the "
                              "folder holding train-images-idx3-ubyte[.gz] and the other three IDX files")

    def signature(self) -> dict:
        """The model these options build and what shapes its variables, as checkpoints record it."""
        if self.model == "lstm":
            return {"model": "lstm", "lstm_layers": self.lstm_layers, "lstm_units": self.lstm_units}
        return {"model": self.model}


OPTION_NAMES = MnistOptions.field_names()
# The Config options whose defaults the presets (and so the gpupar command) set otherwise than model.fit's.
# Not precision: on a CPU with AMX-BF16 the preset's small ConvNet gains nothing in mixed_bfloat16
# (0.80x in gpupar diagnose's step: docs/input-bound.md), so it keeps float32, exact and as model.fit does.
PRESET_DEFAULTS = {"epochs": 5, "display_step": 10, "verbose": 2}
PER_REPLICA_BATCH = 1024  # the presets' batch, per replica, where neither batch option is given


def mnist_options(config: Optional[Config] = None, preset: Optional[MnistOptions] = None, options=None):
    """(Config, MnistOptions) from flat options over `config` and `preset` (the defaults where None).

    Without a `config`, the presets' own defaults apply where the options say nothing: 5 epochs,
    a progress line every 10 steps, one line per epoch, and 1024 examples per replica.

    Raises:
      GpuparError: an unknown option, or a bad value.
    """
    options = dict(options or {})
    if config is None:
        options = {**PRESET_DEFAULTS, **{k: v for k, v in options.items() if v is not None or k not in PRESET_DEFAULTS}}
        if options.get("batch_size") is None and options.get("per_replica_batch_size") is None:
            options["per_replica_batch_size"] = PER_REPLICA_BATCH
    unknown = sorted(set(options) - set(field_names()) - set(OPTION_NAMES))
    if unknown:
        raise GpuparError(f"unknown option(s) {', '.join(unknown)}; valid options are: "
                          f"{', '.join(field_names() + OPTION_NAMES)}")
    own = {name: options.pop(name) for name in list(options) if name in OPTION_NAMES}
    preset = dataclasses.replace(preset, **own) if preset is not None else MnistOptions(**own)
    return Config.from_options(config, **options), preset
