"""A chain model's layers split into pipeline stages, each stage's variables on its own device.

model_fn runs once, as for every other mode (the same seed gives the same initial weights); each
variable then moves to its stage's device. The model's object structure, and so its checkpoint,
is the same whatever the split: a split model's checkpoint restores into an unsplit one and back.
"""

import tensorflow as tf

from gpupar import keras_compat
from gpupar.errors import GpuparError
from gpupar.runtime.stages import stage_of_layers


def chain_layers(model) -> list:
    """The layers of a model that is one chain (each layer takes the previous one's output), in order.

    Raises:
      GpuparError: a subclassed model, or a functional one with a branch, a join, a shared layer
        or several inputs or outputs.
    """
    import keras

    if isinstance(model, keras.Sequential):
        return list(model.layers)
    not_a_chain = (f"stages split a chain of layers (a Sequential model, or a functional one whose every layer takes "
                   f"the previous one's output); {model.name} ({type(model).__name__}) is not one")
    inputs, outputs = getattr(model, "inputs", None), getattr(model, "outputs", None)  # a subclassed model has none
    if not isinstance(model, keras.Model) or not inputs or len(inputs) != 1 or not outputs or len(outputs) != 1:
        raise GpuparError(not_a_chain)
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    previous = model.inputs[0]
    try:
        for layer in layers:
            if layer.input is not previous:
                raise GpuparError(f"{not_a_chain}: layer {layer.name} does not take {getattr(previous, 'name', '')}")
            previous = layer.output
    except (AttributeError, ValueError):  # a layer called more than once has no single input
        raise GpuparError(f"{not_a_chain}: a layer is called more than once") from None
    if previous is not model.outputs[0]:
        raise GpuparError(f"{not_a_chain}: its output is not its last layer's")
    return layers


def build_on_stages(build, ends, devices):
    """Builds the model once, then moves each stage's variables onto its device; returns the model.

    Args:
      build: A function of no arguments that returns the (built) chain model.
      ends: The last layer of every stage but the last, by name or index (runtime.stages.stage_of_layers).
      devices: One device per stage.

    Raises:
      GpuparError: not a chain, stages that do not fit it, or an unbuilt model.
    """
    model = build()
    if not model.built:
        raise GpuparError(f"{model.name} is not built, so its layers have no variables to place yet; give it its "
                          "input shape (keras.Input) so that model_fn returns it built")
    layers = chain_layers(model)
    stage_of = stage_of_layers([layer.name for layer in layers], ends)
    if len(devices) != max(stage_of) + 1:
        raise GpuparError(f"{len(devices)} devices for {max(stage_of) + 1} stages")
    for layer, stage in zip(layers, stage_of):
        for variable in layer.variables:
            _move(variable, devices[stage])
    return model


def _move(variable, device: str):
    """Makes a Keras variable again on `device`, with its name, value and aggregation (keras_compat.remake_variable).

    Keras makes a layer's variables when model_fn builds it, before anyone can say where they
    go (tests/test_model_parallel.py checks that they land on their stage's device).
    """
    with tf.device(device):
        keras_compat.remake_variable(variable)
