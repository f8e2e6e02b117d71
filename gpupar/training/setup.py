"""One run's set-up, whatever the mode: devices, placement, data, model, optimizer, objective; then the mode's builder.

`build_engine` does the set-up that every mode shares, in one place, handing each part of the
Config to the layer that reads it; the mode (gpupar.training.modes) places the replicas and
variables before it and builds the complete Engine after it. Training (gpupar.training.run) and
`gpupar diagnose` build the same engine, so diagnose measures the step and the pipeline that
training would run.
"""

import dataclasses
import logging
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from gpupar.errors import GpuparError, TensorFlowStarted
from gpupar.models.layers import fall_back_from_xla, replica_consistent_state, xla_batch_norm_error
from gpupar.runtime.devices import configure_devices
from gpupar.training.engine import Engine, Prepared
from gpupar.training.inner_loop import unpack
from gpupar.training.objective import Objective
from gpupar.training.own_step import has_own_step, own_step_note

log = logging.getLogger("gpupar")


def build_engine(config, task, mode, cluster=None) -> Engine:
    """Sets up a run of `task` as config says: the one set-up of every mode, then the mode's builder.

    Args:
      config: The run's options.
      task: What to train (gpupar.training.task.Task).
      mode: The mode (gpupar.training.modes.checked).
      cluster: The cluster (gpupar.runtime.cluster) of a multi-worker or parameter-server run.

    Returns:
      The Engine, its input not started yet (Engine.start).

    Raises:
      GpuparError: bad devices, data, model, loss or metrics, found before any training step.
    """
    mode.refuse_task(task, config)
    devices, placement = _placed(config, cluster, task, mode)
    if config.step.precision == "mixed_float16" and not placement.on_gpus:
        log.warning("precision=mixed_float16 without a GPU: the CPU emulates much of float16 math; "
                    "mixed_bfloat16 is the CPU's mixed precision")
    keras.utils.set_random_seed(config.seed)

    train, evaluation = task.train, task.evaluation
    for adapter in (train, evaluation):
        if adapter is not None:
            adapter.prepare(config.input, config.seed)
    log.info("data: %s%s", train.description, f"; evaluation: {evaluation.description}" if evaluation else "")
    if train.resume_note and config.outputs.resume is not False:
        log.info("resume: %s", train.resume_note)
    per_step = train.batch_size(config.input, placement.replicas_per_update)
    global_batch = per_step * config.step.accumulate_steps  # examples per update
    steps_per_epoch = _steps_per_epoch(config.loop, train, global_batch, placement)
    model, compiled, updated, inner, applied = _model_and_optimizer(config.step, task, mode, placement, train)
    own_step = compiled.own_step
    step, loop = _with_compile_options(config.step, config.loop, compiled)
    if placement.on_gpus and fall_back_from_xla(model, xla_batch_norm_error(placement.devices[0])):
        log.warning("XLA could not compile the batch norm on %s, so it runs as Keras' BatchNormalization (the same "
                    "variables, slower): CUDA's ptxas and libdevice are missing; pip install 'tensorflow[and-cuda]' "
                    "brings them", placement.devices[0])
    objective = None if own_step else _checked_objective(compiled, model, train)
    _compiled_for_keras(model, compiled, applied, placement)
    _log_batch(per_step, placement, step, train)
    _log_step_options(step)
    if own_step:
        log.info(own_step_note(model))
    return mode.build(Prepared(
        placement=placement, model=model, optimizer=inner, update_optimizer=applied, updated_variables=updated,
        objective=objective, train=train, evaluation=evaluation, global_batch=global_batch,
        eval_batch=config.input.validation_batch_size or per_step, steps_per_epoch=steps_per_epoch,
        distribution=config.distribution, input=config.input, step=step, loop=loop, seed=config.seed,
        signature=task.signature or _signature(model),
        learning_rate=None if compiled.optimizer is not None else config.step.learning_rate,
        visible_gpus=devices.visible_gpus, own_step=own_step))


def _placed(config, cluster, task, mode):
    """(the DevicePlan, the mode's Placement): devices configured and the strategy made, both logged.

    Raises:
      TensorFlowStarted: TensorFlow ran before it could be set up, naming what in the task started it.
    """
    try:
        devices = configure_devices(config.device_setup)
        placement = mode.place(config, cluster)
    except TensorFlowStarted as e:
        if not task.early_start:
            raise
        raise TensorFlowStarted(f"{e}. Here TensorFlow was started by {task.early_start}") from None
    if devices.intra_op_threads or devices.inter_op_threads:
        log.info("threads: %s per op, %s ops at once",
                 *(n or "TensorFlow's default" for n in (devices.intra_op_threads, devices.inter_op_threads)))
    log.info(placement.description)
    return devices, placement


def _steps_per_epoch(loop, train, global_batch: int, placement) -> int:
    """Steps in one epoch: a pass over the training data, capped by the loop's steps_per_epoch."""
    # A dataset_fn's per-replica batches: each input pipeline gives those of its replicas that share a step.
    steps = train.steps_per_epoch(global_batch, placement.replicas_per_update // placement.input_pipelines)
    if loop.steps_per_epoch is not None:
        steps = min(steps or loop.steps_per_epoch, loop.steps_per_epoch)
    if steps is None:
        raise GpuparError(f"the training data ({train.description}) have no known length, so an epoch has none; "
                          "pass steps_per_epoch")
    return steps


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What the model is trained with: its compile() arguments, or gpupar.fit's for an uncompiled model.

    Attributes:
      optimizer: A Keras optimizer, a function making one, its name, or None (Adam(learning_rate)).
      loss, loss_weights, metrics, weighted_metrics: As model.compile takes them.
      steps_per_execution: compile's steps_per_execution (1: not given).
      jit_compile: compile's jit_compile, resolved by Keras (False on a machine without accelerators).
      by_user: Whether the model came compiled from model_fn.
      own_step: Whether the model's own train_step trains it (gpupar.training.own_step); its compile
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
    settings = model._compile_config.config  # Keras keeps compile()'s arguments here (get_compile_config)
    if settings.get("run_eagerly"):
        raise GpuparError("the model is compiled with run_eagerly=True, which runs model.fit's step eagerly for "
                          "debugging; gpupar runs its step in one tf.function per call: compile without it")
    return Compiled(model.optimizer, settings.get("loss"), settings.get("loss_weights"), settings.get("metrics"),
                    settings.get("weighted_metrics"), int(settings.get("steps_per_execution") or 1),
                    bool(settings.get("jit_compile")), by_user=True, own_step=own_step)


def _refuse_own_step(model, mode, step):
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


def _with_compile_options(step, loop, compiled: Compiled):
    """(StepOptions, LoopOptions) with compile's jit_compile and steps_per_execution, where the options leave them."""
    if compiled.jit_compile and not step.jit_compile:
        step = dataclasses.replace(step, jit_compile=True)
    if compiled.steps_per_execution > 1 and loop.steps_per_call is None:
        loop = dataclasses.replace(loop, steps_per_call=compiled.steps_per_execution)
    return step, loop


def _model_and_optimizer(step, task, mode, placement, train):
    """(model, its Compiled arguments, variables updated, optimizer, optimizer that applies updates).

    All are made under the placement's scope, the model's layers in the run's dtype policy.
    """
    previous_policy = keras.config.dtype_policy()
    if step.precision != "float32":
        keras.config.set_dtype_policy(step.precision)  # the user's layers compute in 16 bits, weights stay float32
    try:
        with placement.strategy.scope():
            with replica_consistent_state():  # the model's state only: the optimizer's keeps Keras' aggregation
                model = mode.build_model(lambda: _refuse_own_step(task.build_model(), mode, step), placement,
                                         train.sample())
            compiled = compile_arguments(model, task)
            if compiled.own_step:
                if not compiled.optimizer.built:
                    compiled.optimizer.build(model.trainable_variables)  # as model.fit builds it
                return model, compiled, model.trainable_variables, compiled.optimizer, compiled.optimizer
            updated, split = mode.updated_variables(model)
            inner = _optimizer(compiled.optimizer, step.learning_rate)
            applied = _loss_scaled(inner, step)
            applied.build(updated)  # each slot variable is placed beside its variable
    finally:
        keras.config.set_dtype_policy(previous_policy)
    for line in split:
        log.info("variable %s", line)
    return model, compiled, updated, inner, applied


def _compiled_for_keras(model, compiled: Compiled, applied, placement):
    """Leaves the model compiled as the user would after model.fit: evaluate, predict and save work on it.

    A model that came compiled keeps its compile, with the optimizer that trained it; one that
    did not is compiled with fit's loss and metrics, under the strategy's scope.
    """
    if compiled.by_user:
        model.optimizer = applied  # where Keras' callbacks (ReduceLROnPlateau, LearningRateScheduler) look for it
        return
    with placement.strategy.scope():
        model.compile(optimizer=applied, loss=compiled.loss, metrics=compiled.metrics)


def _log_batch(per_step: int, placement, step, train):
    """The batch line: the global batch, what each replica gets, and the examples of an update."""
    replicas = placement.replicas_per_update
    share = f"{per_step // replicas} per replica on {replicas} replicas" if replicas > 1 else "on one replica"
    if per_step % replicas:
        share = f"about {per_step / replicas:.1f} per replica on {replicas} replicas"
    own = f" ({train.form}'s own batches)" if train.own_batches else ""
    update = f"; {per_step * step.accumulate_steps} per update ({step.accumulate_steps} accumulated)" if \
        step.accumulate_steps > 1 else ""
    log.info("batch: %d examples per step%s, %s%s", per_step, own, share, update)


def _log_step_options(step):
    """One line for each option that changes the step: accumulation, precision and XLA."""
    if step.accumulate_steps > 1:
        log.info("accumulation: each update adds the gradients of %d micro-batches, one after another, then "
                 "all-reduces once: one step on their whole batch", step.accumulate_steps)
    if step.precision != "float32" or step.jit_compile:
        log.info("step: %s%s", step.precision, ", compiled with XLA" if step.jit_compile else "")


def _optimizer(given, learning_rate: float):
    """The optimizer to train with, made under the strategy's scope (Keras' optimizers must be)."""
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
    elif given.built:
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


def _signature(model) -> dict:
    """What a checkpoint records of a model it did not get a preset's options for (Keras numbers its names)."""
    parameters = sum(int(np.prod(weight.shape)) for weight in model.weights)  # count_params() needs a built model
    return {"model": type(model).__name__, "variables": len(model.weights), "parameters": parameters}


def _checked_objective(compiled: Compiled, model, train):
    """The Objective for the model's outputs, after the checks that need the model and one batch.

    Raises:
      GpuparError: labels outside the model's output range, a loss of one scalar per batch, a
        metric whose state does not add up, names that do not fit the outputs.
    """
    x, y, sample_weight = unpack(train.sample())
    y_pred = tf.nest.map_structure(lambda t: np.asarray(t, np.float32), model(x, training=False))
    objective = Objective(compiled.loss, compiled.metrics, y, y_pred, getattr(model, "output_names", None),
                          compiled.loss_weights, compiled.weighted_metrics, model_losses=bool(model.losses))
    all_labels = train.labels()
    all_labels = y if all_labels is None else all_labels  # every label where they are in memory
    for term in objective.losses:
        if term.sparse:
            labels = np.asarray(all_labels if term.key is None else all_labels[term.key])
            classes = (y_pred if term.key is None else y_pred[term.key]).shape[-1]
            if labels.size and (labels.min() < 0 or labels.max() >= classes):
                raise GpuparError(f"the labels reach {labels.min()}..{labels.max()}, but the model has {classes} "
                                  f"outputs (classes 0..{classes - 1}); fix the labels or the model's last layer")
    for name in objective.batch_level(y, y_pred):
        log.info("loss %r gives one value per batch, not one per example: on several replicas the step's loss is the "
                 "mean of each replica's value (as model.fit's under a strategy), not the global batch's", name)
    objective.check_additive(y, y_pred, sample_weight)
    objective.reset()
    return objective
