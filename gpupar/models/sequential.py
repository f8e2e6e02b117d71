"""gpupar's models as Keras Sequential models whose pipeline stages build on devices of their own."""

import contextlib

import keras
import tensorflow as tf

from gpupar.models.layers import replica_consistent_state


def layer_stages(layers) -> list:
    """The pipeline stage of each layer: where a model splits for strategy=model_parallel.

    A new stage starts at each LSTM layer and at Flatten, once the current stage holds a layer
    with weights: the ConvNet splits into its convolutions and its dense head, the LSTM into one
    stage per LSTM layer (the reshape joins the first, the dense head the last).
    """
    stages, stage, weighted = [], 0, False
    for layer in layers:
        if isinstance(layer, (keras.layers.LSTM, keras.layers.Flatten)) and weighted:
            stage, weighted = stage + 1, False
        weighted = weighted or isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense, keras.layers.LSTM))
        stages.append(stage)
    return stages


def staged_sequential(name, layers, stage_devices=None):
    """keras.Sequential([Input((28, 28, 1)), *layers]); with stage_devices, stage k's variables on device k.

    Layers are added one at a time so each builds (creates its variables) under its stage's
    tf.device. The object structure, and so the checkpoint, is the same with or without devices:
    a split model's checkpoint restores into an unsplit one and back.
    """
    stages = layer_stages(layers)
    with replica_consistent_state():
        model = keras.Sequential(name=name)
        model.add(keras.Input((28, 28, 1)))
        for layer, stage in zip(layers, stages):
            with tf.device(stage_devices[stage]) if stage_devices else contextlib.nullcontext():
                model.add(layer)
    return model
