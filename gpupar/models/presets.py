"""The models gpupar trains by name (config.model), and what a checkpoint records of them."""

from typing import Optional, Sequence

from gpupar.models.convnet import build_convnet
from gpupar.models.lstm import build_lstm


def build_model(config, stage_devices: Optional[Sequence[str]] = None):
    """The model config.model names, built with config's options (stage_devices: see staged_sequential)."""
    dtype = None if config.precision == "float32" else config.precision
    if config.model == "lstm":
        return build_lstm(config.lstm_layers, config.lstm_units, seed=config.seed, stage_devices=stage_devices,
                          dtype=dtype)
    return build_convnet(config.dropout, config.sync_batch_norm, seed=config.seed, stage_devices=stage_devices,
                         dtype=dtype)


def model_signature(config) -> dict:
    """The model config builds and the options that shape its variables, as checkpoints record it."""
    if config.model == "lstm":
        return {"model": "lstm", "lstm_layers": config.lstm_layers, "lstm_units": config.lstm_units}
    return {"model": config.model}


def num_stages(config) -> int:
    """How many pipeline stages config.model has."""
    return config.lstm_layers if config.model == "lstm" else 2
