"""Saving a trained model as a .keras file that Keras alone loads: gpupar's layers become Keras' own.

XlaBatchNormalization is keras.layers.BatchNormalization with a faster training step: at
inference it is the Keras layer; RandomAffine only augments in training: at inference it is
keras.layers.Identity. A Sequential or functional model is cloned with them swapped (the same weights, the same
predictions), so `keras.models.load_model` reads the file in a process that never imports gpupar.
A subclassed model is saved as it is; if it holds gpupar's layer, `import gpupar.models.layers`
before loading it (it is registered under the package name "gpupar").
"""

import os

import keras

from gpupar import keras_compat
from gpupar.errors import GpuparError
from gpupar.models.layers import RandomAffine, XlaBatchNormalization


def _keras_layer(layer):
    """The Keras layer a gpupar layer stands for at inference, or a plain clone of any other layer."""
    if isinstance(layer, XlaBatchNormalization):
        return keras.layers.BatchNormalization.from_config(layer.get_config())
    if isinstance(layer, RandomAffine):
        return keras.layers.Identity(name=layer.name)
    return layer.__class__.from_config(layer.get_config())


def keras_only(model):
    """The model with gpupar's layers swapped for Keras' (the model itself where Keras cannot clone it so)."""
    gpupar_layers = [layer for layer in keras_compat.all_layers(model)
                     if isinstance(layer, (XlaBatchNormalization, RandomAffine))]
    if not gpupar_layers:
        return model
    try:
        clone = keras.models.clone_model(model, clone_function=_keras_layer)
    except ValueError:  # Keras clones layer by layer only a Sequential or functional model
        return model
    for old, new in zip(model.layers, clone.layers):
        if not isinstance(old, RandomAffine):  # its seed state has no place at inference
            new.set_weights(old.get_weights())
    return clone


def save_model(model, path: str):
    """Writes keras_only(model) to `path`, a .keras file.

    Raises:
      GpuparError: a path that does not end in .keras, or that cannot be written.
    """
    if not str(path).endswith(".keras"):
        raise GpuparError(f"{path}: Keras saves models as .keras files; give a path that ends in .keras")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        keras_only(model).save(path)
    except OSError as e:
        raise GpuparError(f"{path}: cannot write the model ({e.strerror or e})") from None
