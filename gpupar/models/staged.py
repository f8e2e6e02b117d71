"""A chain model's layers split into pipeline stages, each stage's variables made on its own device.

    model, stage_of = build_on_stages(model_fn, ends=("conv_out",), devices=("/gpu:0", "/gpu:1"))

Keras makes a layer's variables when the layer is built, inside model_fn, before anyone can say
where they go. So model_fn runs twice: once to learn which layer makes which variable, in which
order (a probe, on the default device), and once more with each variable made under its
stage's device. The model's object structure, and so its checkpoint, is the same whatever the
split: a split model's checkpoint restores into an unsplit one and back.
"""

import tensorflow as tf

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
    """Builds the model with each stage's variables on its device; returns (model, the stage of each chain layer).

    Args:
      build: A function of no arguments that returns the (built) chain model, the same each time.
      ends: The last layer of every stage but the last, by name or index (runtime.stages.stage_of_layers).
      devices: One device per stage.

    Raises:
      GpuparError: not a chain, stages that do not fit it, an unbuilt model, or a build that made
        other variables the second time.
    """
    created = []

    def record(next_creator, **kwargs):
        variable = next_creator(**kwargs)
        created.append(variable)
        return variable

    with tf.variable_creator_scope(record):
        probe = build()
    if not probe.built:
        raise GpuparError(f"{probe.name} is not built, so its layers have no variables to place yet; give it its "
                          "input shape (keras.Input) so that model_fn returns it built")
    layers = chain_layers(probe)
    stage_of = stage_of_layers([layer.name for layer in layers], ends)
    if len(devices) != max(stage_of) + 1:
        raise GpuparError(f"{len(devices)} devices for {max(stage_of) + 1} stages")
    owner = {id(variable.value): stage for layer, stage in zip(layers, stage_of) for variable in layer.variables}
    placed = [devices[owner.get(id(variable), 0)] for variable in created]  # the rest (none in a chain) on stage 0
    made = []

    def place(next_creator, **kwargs):
        with tf.device(placed[len(made)] if len(made) < len(placed) else devices[0]):
            made.append(next_creator(**kwargs))
        return made[-1]

    del probe, created
    with tf.variable_creator_scope(place):
        model = build()
    if len(made) != len(placed):
        raise GpuparError(f"model_fn made {len(made)} variables the second time it was called, {len(placed)} the "
                          "first; it must build the same model each time")
    return model, stage_of
