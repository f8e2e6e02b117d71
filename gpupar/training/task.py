"""What a run trains: the model, the data, the loss and metrics, the optimizer and the callbacks.

`user_task` checks what `gpupar.fit` was given, before TensorFlow starts where it can; the MNIST
presets are Tasks too (gpupar.training.presets). The engine resolves the data after it has
created the strategy: TensorFlow must not run before a multi-worker strategy exists.
"""

import dataclasses
from typing import Any, Callable, Optional, Sequence

from gpupar.errors import GpuparError


@dataclasses.dataclass
class Task:
    """One run's model, data and objective.

    Attributes:
      build_model: build_model() -> keras.Model, called under the strategy's scope (twice for
        model_parallel: gpupar.models.staged).
      sources: sources() -> (training Source, evaluation Source or None) (gpupar.data.sources).
      loss: The loss: a Keras name, a keras.losses.Loss, a function, or one per output.
      metrics: Keras metric names or objects, or one list per output.
      optimizer: A Keras optimizer, rebuilt from its config under the strategy's scope; None: Adam.
      callbacks: Keras callbacks.
      signature: The model and its shape-defining options for checkpoints; None: read off the built model.
      device_transform: device_transform(x, step) on each replica's inputs (the preset's augmentation), or None.
      train_form: What the training data are, as errors name them ("a dataset_fn", "a tuple", ...).
      per_worker_input: Whether each parameter-server worker can make its own input from the
        training data: a dataset_fn, or the MNIST presets' arrays, which gpupar shards per worker.
      stage_ends: Where the model's pipeline stages end, for strategy=model_parallel when the
        config gives no stages (the presets' own split); None: the config must give them.
      early_start: What among the arguments started TensorFlow before gpupar could set up its
        devices or cluster, and how to avoid it; "" when nothing did.
    """

    build_model: Callable
    sources: Callable
    loss: Any = "sparse_categorical_crossentropy"
    metrics: Any = ("accuracy",)
    optimizer: Any = None
    callbacks: Sequence = ()
    signature: Optional[dict] = None
    device_transform: Optional[Callable] = None
    train_form: str = ""
    per_worker_input: bool = False
    stage_ends: Optional[tuple] = None
    early_start: str = ""


def user_task(model_fn, train_data, eval_data, loss, metrics, optimizer, callbacks) -> Task:
    """The Task of gpupar.fit's arguments, with the checks that need no TensorFlow done now.

    Raises:
      GpuparError: a built model instead of a function, something that is not a callable, an
        optimizer or callback of the wrong kind.
    """
    import keras

    from gpupar.data import sources

    if isinstance(model_fn, keras.Model):
        raise GpuparError("model_fn is a built keras.Model; pass a function that builds it, e.g. model_fn=lambda: "
                          "keras.Sequential([...]): gpupar calls it under the strategy's scope, so that the "
                          "strategy places its variables")
    if not callable(model_fn):
        raise GpuparError(f"model_fn is a {type(model_fn).__name__}; pass a function of no arguments that returns a "
                          "keras.Model")
    if optimizer is not None and not isinstance(optimizer, (str, keras.optimizers.Optimizer)) and not (
            callable(optimizer) and not isinstance(optimizer, type)):
        raise GpuparError(f"optimizer is a {type(optimizer).__name__}; pass a keras.optimizers.Optimizer, a function "
                          "that returns one, a Keras optimizer name such as 'adam', or None for Adam(learning_rate)")
    for callback in callbacks:
        if not isinstance(callback, keras.callbacks.Callback):
            raise GpuparError(f"callbacks holds a {type(callback).__name__}; give keras.callbacks.Callback objects")

    def build_model():
        model = model_fn()
        if not isinstance(model, keras.Model):
            raise GpuparError(f"model_fn returned a {type(model).__name__}, not a keras.Model")
        if type(model).train_step is not keras.Model.train_step:
            raise GpuparError(f"{type(model).__name__} has its own train_step, which gpupar does not run (it runs a "
                              "distributed step of its own); put the computation in call() and pass the loss to fit")
        return model

    def resolved():
        return (sources.resolve(train_data, "train_data"),
                None if eval_data is None else sources.resolve(eval_data, "eval_data"))

    dataset_fn = callable(train_data) and not isinstance(train_data, (tuple, list))
    return Task(build_model, resolved, loss, metrics, optimizer, tuple(callbacks),
                early_start=_early_start(optimizer, train_data, eval_data),
                train_form="a dataset_fn" if dataset_fn else f"a {type(train_data).__name__}",
                per_worker_input=dataset_fn)


def _early_start(optimizer, train_data, eval_data) -> str:
    """What among fit's arguments has started TensorFlow already (a Keras optimizer, a tf.data.Dataset)."""
    import keras

    causes = []
    if isinstance(optimizer, keras.optimizers.Optimizer):
        causes.append("the optimizer object, which Keras gave its variables when it was made: pass a function that "
                      f"makes it, e.g. optimizer=lambda: keras.optimizers.{type(optimizer).__name__}(...), or its name")
    if any(type(data).__module__.startswith("tensorflow") for data in (train_data, eval_data)):
        causes.append("the tf.data.Dataset, made before the call: pass a dataset_fn(input_context) that makes it")
    return "; ".join(causes)
