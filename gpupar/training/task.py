"""What a run trains: the model, the data, the loss and metrics, the optimizer and the callbacks.

`user_task` checks what `gpupar.fit` was given, before TensorFlow starts where it can; the MNIST
presets are Tasks too (gpupar.presets.mnist). The data are input adapters (gpupar.data.adapters),
prepared once the strategy exists: TensorFlow must not run before a multi-worker strategy does.
"""

import dataclasses
from typing import Any, Callable, Optional, Sequence

from gpupar.data.adapters import DataAdapter
from gpupar.errors import GpuparError


@dataclasses.dataclass(frozen=True)
class Task:
    """One run's model, data and objective.

    Attributes:
      build_model: build_model() -> keras.Model, called under the strategy's scope.
      train: The training data's adapter.
      validation: The validation data's adapter (model.fit's validation_data), or None.
      loss: For a model that comes uncompiled: a Keras name, a keras.losses.Loss, a function, or
        one per output; None: none but the model's own (add_loss).
      metrics: For a model that comes uncompiled: Keras metric names or objects, or one list per output.
      optimizer: For a model that comes uncompiled: a Keras optimizer, rebuilt from its config
        under the strategy's scope; None: Adam.
      callbacks: Keras callbacks.
      signature: The model and its shape-defining options for checkpoints; None: read off the built model.
      early_start: What among the arguments started TensorFlow before gpupar could set up its
        devices or cluster, and how to avoid it; "" when nothing did.
      model: The model itself where gpupar.fit was given a built one (build_model returns it), else None.
      seeded: Whether the run seeds Keras' random numbers (keras.utils.set_random_seed(seed)): the
        presets do, gpupar.fit where its seed= is given; else the script's own seeding stands.
    """

    build_model: Callable
    train: DataAdapter
    validation: Optional[DataAdapter] = None
    loss: Any = None
    metrics: Any = None
    optimizer: Any = None
    callbacks: Sequence = ()
    signature: Optional[dict] = None
    early_start: str = ""
    model: Any = None
    seeded: bool = True


def user_task(model, train, validation, loss, metrics, optimizer, callbacks, raw=(), seeded=False) -> Task:
    """The Task of gpupar.fit's arguments (the data as adapters), with the checks that need no TensorFlow done now.

    model: a built keras.Model, or a function that returns one. raw: what the user gave as data,
    to name what in it started TensorFlow early.

    Raises:
      GpuparError: something that is neither a keras.Model nor a function, an optimizer or
        callback of the wrong kind.
    """
    import keras

    built = model if isinstance(model, keras.Model) else None
    if built is None and not callable(model):
        raise GpuparError(f"model is a {type(model).__name__}; pass a keras.Model (built, as for model.fit) or a "
                          "function of no arguments that returns one")
    if optimizer is not None and not isinstance(optimizer, (str, keras.optimizers.Optimizer)) and not (
            callable(optimizer) and not isinstance(optimizer, type)):
        raise GpuparError(f"optimizer is a {type(optimizer).__name__}; pass a keras.optimizers.Optimizer, a function "
                          "that returns one, a Keras optimizer name such as 'adam', or None for Adam(learning_rate)")
    for callback in callbacks:
        if not isinstance(callback, keras.callbacks.Callback):
            raise GpuparError(f"callbacks holds a {type(callback).__name__}; give keras.callbacks.Callback objects")
    _check_names(loss, keras.losses.get, "loss", "a Keras loss name such as 'sparse_categorical_crossentropy', "
                 "'categorical_crossentropy' or 'mse', or pass a keras.losses.Loss or a function(y_true, y_pred)")
    _check_names(metrics, keras.metrics.get, "metrics", "a Keras metric name such as 'accuracy', 'mae' or 'auc', or "
                 "pass a keras.metrics.Metric")

    def build_model():
        made = built if built is not None else model()
        if not isinstance(made, keras.Model):
            raise GpuparError(f"model_fn returned a {type(made).__name__}, not a keras.Model")
        return made

    return Task(build_model, train, validation, loss, metrics, optimizer, tuple(callbacks),
                early_start=_early_start(built, optimizer, metrics, raw), model=built, seeded=seeded)


# Names that Keras' compile resolves by the shapes of the labels and outputs (compile_utils.get_loss, get_metric).
_BY_SHAPES = ("crossentropy", "ce", "accuracy", "acc")


def _check_names(given, resolve, what: str, use: str):
    """Refuses a name in fit's loss or metrics that Keras does not know, before TensorFlow starts."""
    for name in _flat(given):
        if isinstance(name, str) and name.lower() not in _BY_SHAPES:
            try:
                resolve(name)
            except ValueError:
                raise GpuparError(f"{what}: {name!r} is not a Keras name; use {use}") from None


def _early_start(model, optimizer, metrics, data) -> str:
    """What among fit's arguments has started TensorFlow already (a model, a Keras optimizer or metric, a dataset)."""
    import keras

    fix = "call gpupar.strategy(...) with the device options first thing in the script, before it"
    causes = []
    if model is not None:
        causes.append(f"the model, built before the call: {fix}, and build the model under its scope")
    if isinstance(optimizer, keras.optimizers.Optimizer):
        causes.append(f"the optimizer object, which Keras gave its variables when it was made: {fix}, or pass a "
                      f"function that makes it (optimizer=lambda: keras.optimizers.{type(optimizer).__name__}(...))")
    made = [m for m in _flat(metrics) if isinstance(m, keras.metrics.Metric)]
    if made:
        causes.append(f"the metric object {made[0].name!r}, which Keras gave its variables when it was made: {fix}, "
                      "or pass its name, or compile the model in model_fn")
    tensors = [d for d in _flat(data) if type(d).__module__.startswith("tensorflow")]
    if tensors:
        causes.append(f"the {type(tensors[0]).__name__} made before the call: {fix}")
    return "; ".join(causes)


def _flat(structure) -> list:
    """The leaves of a structure of lists, tuples and dicts."""
    if isinstance(structure, dict):
        structure = list(structure.values())
    if isinstance(structure, (list, tuple)):
        return [leaf for item in structure for leaf in _flat(item)]
    return [structure]
