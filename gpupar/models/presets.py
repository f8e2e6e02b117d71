"""The models gpupar trains by name (config.model), where model_parallel splits them, and what a checkpoint records."""

from gpupar.models import convnet, lstm


def build_model(config):
    """The model config.model names, built with config's options."""
    dtype = None if config.precision == "float32" else config.precision
    if config.model == "lstm":
        return lstm.build_lstm(config.lstm_layers, config.lstm_units, seed=config.seed, dtype=dtype)
    return convnet.build_convnet(config.dropout, config.sync_batch_norm, seed=config.seed, dtype=dtype)


def model_signature(config) -> dict:
    """The model config builds and the options that shape its variables, as checkpoints record it."""
    if config.model == "lstm":
        return {"model": "lstm", "lstm_layers": config.lstm_layers, "lstm_units": config.lstm_units}
    return {"model": config.model}


def stage_ends(config) -> tuple:
    """Where config.model's pipeline stages end (runtime.stages.stage_of_layers), for strategy=model_parallel."""
    return lstm.stage_ends(config.lstm_layers) if config.model == "lstm" else convnet.STAGE_ENDS
