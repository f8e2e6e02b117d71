"""A run's model and its optimizer(s), under the mode's placement: built by model_fn, given built, or rebuilt.

`model_and_optimizer` makes them for the one set-up (gpupar.training.setup): the model from the
task's model_fn in the run's dtype policy, or the model gpupar.fit was given (trained as it is
where it was built under the run's strategy, or rebuilt under it from its config, weights and
compile arguments), and the optimizer from the model's compile (kept as it is for a given
model, so its state carries from fit to fit) or from gpupar.fit's arguments.
"""

import dataclasses
import logging
from typing import Any

import keras
import tensorflow as tf

from gpupar.errors import GpuparError
from gpupar.models.layers import replica_consistent_state
from gpupar.training.steps.own import has_own_step

log = logging.getLogger("gpupar")


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What the model is trained with: its compile() arguments, or gpupar.fit's for an uncompiled model.

    Attributes:
      optimizer: A Keras optimizer, a function making one, its name, or None (Adam(learning_rate)).
      loss, loss_weights, metrics, weighted_metrics: As model.compile takes them.
      steps_per_execution: compile's steps_per_execution (1: not given).
      jit_compile: compile's jit_compile, resolved by Keras (False on a machine without accelerators).
      by_user: Whether the model came compiled from model_fn.
      own_step: Whether the model's own train_step trains it (gpupar.training.steps.own); its compile
        says only the optimizer (its own, used as it is), steps_per_execution and jit_compile.
    """

    optimizer: Any = None
    loss: Any = None
    loss_weights: Any = None
    metrics: Any = None
    weighted_metrics: Any = None
    steps_per_execution: int = 1
    jit_compile: bool = False
    by_user: bool = False
    own_step: bool = False


def compile_arguments(model, task) -> Compiled:
    """The model's compile() arguments where model_fn compiled it, else gpupar.fit's loss, metrics and optimizer.

    Raises:
      GpuparError: a compiled model and fit's own loss, metrics or optimizer too; run_eagerly.
    """
    own_step = has_own_step(model)
    if not getattr(model, "compiled", False):
        if own_step:
            raise GpuparError(f"{type(model).__name__} has its own train_step and is not compiled; compile it in "
                              "model_fn as before model.fit (its step uses what compile gives it)")
        return Compiled(task.optimizer, task.loss, metrics=task.metrics)
    given = [name for name in ("loss", "metrics", "optimizer") if getattr(task, name) is not None]
    if given:
        raise GpuparError(f"model_fn returns a model compiled with its own {given[0]}, and gpupar.fit got {given[0]}= "
                          f"too; drop one of them (the rule: compile in model_fn, call gpupar.fit as model.fit)")
    if model.run_eagerly:
        raise GpuparError("the model is compiled with run_eagerly=True, which runs model.fit's step eagerly for "
                          "debugging; gpupar runs its step in one tf.function per call: compile without it")
    settings = _compile_settings(model)
    return Compiled(model.optimizer, model.loss, settings.get("loss_weights"), settings.get("metrics"),
                    settings.get("weighted_metrics"), int(model.steps_per_execution or 1), bool(model.jit_compile),
                    by_user=True, own_step=own_step)


def _compile_settings(model) -> dict:
    """compile()'s metrics, weighted_metrics and loss_weights as given: the one read of Keras' private attributes.

    Keras 3 keeps the optimizer, loss, jit_compile, run_eagerly and steps_per_execution as public
    attributes, but the metrics as given only in `_compile_config` (get_compile_config() returns
    them serialized, metric objects as dicts). tests/test_fit.py trains compiled metrics through it.
    """
    return model._compile_config.config


def _checked_own_step(model, mode, step):
    """The model, unless it has its own train_step and the mode or the step options cannot run it: one line, its class.

    Asked as soon as model_fn returns, before a mode's own checks of the model.
    """
    if not has_own_step(model):
        return model
    name = type(model).__name__
    if not mode.takes_own_step:
        raise GpuparError(f"{name} has its own train_step, which the {mode.name} mode cannot run (its step is "
                          "gpupar's, split over stages or workers); train it with strategy=mirrored, one_device, "
                          "central_storage or multi_worker_mirrored")
    if step.accumulate_steps > 1:
        raise GpuparError(f"{name} has its own train_step, which applies its own updates: accumulate_steps="
                          f"{step.accumulate_steps} cannot add up its gradients; use accumulate_steps=1 (or accumulate "
                          "in the step)")
    if step.nan_policy == "skip":
        raise GpuparError(f"{name} has its own train_step, which applies its own updates: nan_policy=skip cannot drop "
                          "them; use nan_policy=stop (training stops at a non-finite log, the last checkpoint kept)")
    if step.precision == "mixed_float16":
        raise GpuparError(f"{name} has its own train_step, whose optimizers do not scale the loss as mixed_float16 "
                          "needs; use precision=mixed_bfloat16 or float32, or wrap them in "
                          "keras.optimizers.LossScaleOptimizer in the model and keep precision=float32")
    return model


def model_and_optimizer(step, task, mode, placement, train):
    """(model, placement, its Compiled arguments, variables updated, optimizer, optimizer that applies updates).

    All are made under the placement's scope, the model's layers in the run's dtype policy. A
    model given built keeps its optimizer (and so its state from an earlier fit) where it trains
    as it is (_given_model); the placement is then the one it trains under.
    """
    previous_policy = keras.config.dtype_policy()
    if step.precision != "float32":
        keras.config.set_dtype_policy(step.precision)  # the user's layers compute in 16 bits, weights stay float32
    try:
        if task.model is not None:
            model, placement = _given_model(task.model, mode, placement, step)
        with placement.strategy.scope():
            with replica_consistent_state():  # the model's state only: the optimizer's keeps Keras' aggregation
                if task.model is None:
                    model = mode.build_model(lambda: _checked_own_step(task.build_model(), mode, step), placement,
                                             train.sample())
                elif model is not task.model:
                    model = _rebuilt(task.model)
            compiled = compile_arguments(task.model or model, task)
            if compiled.own_step:
                if not compiled.optimizer.built:
                    compiled.optimizer.build(model.trainable_variables)  # as model.fit builds it
                return model, placement, compiled, model.trainable_variables, compiled.optimizer, compiled.optimizer
            updated, split = mode.updated_variables(model)
            if model is task.model and compiled.by_user:
                inner, applied = _kept_optimizer(model.optimizer, step)
            else:  # a fresh one: from model_fn's compile, fit's arguments, or a rebuilt model's compile
                inner = _optimizer(compiled.optimizer, step.learning_rate, used=task.model is not None)
                applied = _loss_scaled(inner, step)
            if not applied.built:
                applied.build(updated)  # each slot variable is placed beside its variable
    finally:
        keras.config.set_dtype_policy(previous_policy)
    for line in split:
        log.info("variable %s", line)
    return model, placement, compiled, updated, inner, applied


def _given_model(model, mode, placement, step):
    """(the given model, or a marker that it must be rebuilt; the placement it trains under).

    A model built under the run's strategy trains as it is; one built outside any strategy trains
    as it is on one device (under TensorFlow's default strategy, as model.fit without one) and is
    rebuilt under the strategy for several.

    Raises:
      GpuparError: a mode that builds the model itself, a model of another strategy, a model that
        Keras cannot rebuild, precision for a built model.
    """
    if not mode.takes_built_model:
        raise GpuparError(f"strategy={mode.name} places the variables as it builds the model; pass a function that "
                          "builds and compiles it: gpupar.fit(model_fn, ...)")
    _checked_own_step(model, mode, step)
    if step.precision != "float32":
        raise GpuparError(f"precision={step.precision} sets the dtype policy of the layers gpupar builds, and this "
                          f"model is built already: call keras.config.set_dtype_policy({step.precision!r}) before "
                          "building it (and drop precision)")
    made_under = strategy_of(model)
    if made_under is placement.strategy:
        return model, placement
    if made_under is not None:
        raise GpuparError(f"{model.name} was built under another strategy than this fit's ({placement.description}); "
                          "build it under gpupar.strategy(...) with the fit's options, or fit it without strategy "
                          "options")
    if placement.replicas == 1 and placement.workers == 1 and len(placement.devices) == 1:
        return model, dataclasses.replace(placement, strategy=tf.distribute.get_strategy())
    if not _clonable(model):
        raise GpuparError(f"{model.name} ({type(model).__name__}) was built outside any strategy, and Keras can rebuild "
                          "only Sequential and functional models; build it under the strategy: strategy = "
                          "gpupar.strategy(...) first thing in the script, then `with strategy.scope():` around its "
                          "build and compile")
    log.info("model: %s was built outside any strategy, so it is rebuilt under this one from its config, weights "
             "and compile arguments (its optimizer's state starts afresh); its trained weights are copied back at the "
             "end", model.name)
    return None, placement


def strategy_of(model):
    """The tf.distribute.Strategy whose scope the model was made in, None outside any: the one private read of Keras'
    trainer (keras/src/backend/tensorflow/trainer.py sets it when a model is made; tests/test_front_door.py checks it).
    """
    return model._distribute_strategy


def _clonable(model) -> bool:
    return isinstance(model, keras.Sequential) or getattr(model, "_is_graph_network", False)


def _rebuilt(model):
    """A copy of a Sequential or functional model, made in the current scope, with its weights."""
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    return clone


def _kept_optimizer(optimizer, step):
    """(the optimizer checkpoints hold, the one that applies updates) of a built model's own optimizer, kept as it is.

    Its state carries over from fit to fit, as Keras' does; a loss-scale optimizer (compile's,
    under mixed_float16) applies the updates itself.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer, optimizer
    return optimizer, _loss_scaled(optimizer, step)


def compiled_for_keras(model, compiled: Compiled, applied, placement):
    """Leaves the model compiled as the user would after model.fit: evaluate, predict and save work on it.

    A model that came compiled keeps its compile, with the optimizer that trained it; one that
    did not is compiled with fit's loss and metrics, under the strategy's scope.
    """
    if compiled.by_user:
        model.optimizer = applied  # where Keras' callbacks (ReduceLROnPlateau, LearningRateScheduler) look for it
        return
    with placement.strategy.scope():
        model.compile(optimizer=applied, loss=compiled.loss, metrics=compiled.metrics)


def _optimizer(given, learning_rate: float, used: bool = False):
    """The optimizer to train with, made under the strategy's scope (Keras' optimizers must be).

    used: `given` may have trained already (a rebuilt model's): a fresh one is made from its config.
    """
    if given is None:
        return keras.optimizers.Adam(learning_rate)
    if isinstance(given, keras.optimizers.LossScaleOptimizer):
        given = given.inner_optimizer  # compile wraps it under mixed_float16; gpupar wraps it again as the run says
    if isinstance(given, str):
        try:
            made = keras.optimizers.get(given)
        except ValueError:
            raise GpuparError(f"optimizer={given!r} is not a Keras optimizer name; use one such as 'adam' or 'sgd', or "
                              "pass a keras.optimizers.Optimizer") from None
    elif callable(given) and not isinstance(given, keras.optimizers.Optimizer):
        made = given()  # a function that makes it: called here, under the strategy's scope
        if not isinstance(made, keras.optimizers.Optimizer):
            raise GpuparError(f"the optimizer function returned a {type(made).__name__}, not a "
                              "keras.optimizers.Optimizer")
    elif given.built and not used:
        raise GpuparError("the optimizer has been used already (it has variables); pass a new one: gpupar makes it "
                          "again under the strategy's scope from its config")
    else:
        made = given.__class__.from_config(given.get_config())
    if made.gradient_accumulation_steps:
        raise GpuparError(f"the optimizer has gradient_accumulation_steps={made.gradient_accumulation_steps}, Keras' "
                          "own accumulation, which gpupar does not run under a strategy; pass accumulate_steps="
                          f"{made.gradient_accumulation_steps} to gpupar instead (it adds up the batches' gradients in "
                          "the step, then all-reduces them once)")
    return made


def _loss_scaled(inner, step):
    if step.precision == "mixed_float16":  # scales the loss so float16 gradients neither vanish nor overflow
        return keras.optimizers.LossScaleOptimizer(inner)
    if step.nan_policy == "skip":
        # Keras' loss-scale optimizer is what skips non-finite steps. Its scale starts at 1, halves
        # on a skipped step (the engine puts it back to 1 after every call) and never grows; powers
        # of two scale float32 exactly.
        return keras.optimizers.LossScaleOptimizer(inner, initial_scale=1.0, dynamic_growth_steps=2**31 - 1)
    return inner
