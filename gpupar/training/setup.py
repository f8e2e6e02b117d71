"""One run's set-up, whatever the mode: devices, placement, data, model, optimizer, step; the Trainer, made once.

`build_trainer` does the set-up that every mode shares, in one place, handing each part of the
Config to the layer that reads it and asking the mode (gpupar.training.modes) for its parts:
the placement, the model's build, the step, the calls, the input and the evaluation. Training
(gpupar.training.run) and `gpupar diagnose` build the same Trainer, so diagnose measures the
step and the pipeline that training would run.
"""

import dataclasses
import logging
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from gpupar.errors import GpuparError, TensorFlowStarted
from gpupar.models.layers import fall_back_from_xla, global_seed_generator, replica_consistent_state, xla_batch_norm_error
from gpupar.runtime.devices import configure_devices
from gpupar.runtime.precision import PrecisionPlan, machine_precision
from gpupar.training.inner_loop import unpack
from gpupar.training.objective import Objective
from gpupar.training.steps.own import has_own_step, own_step_note
from gpupar.training.steps.parts import finite_check
from gpupar.training.trainer import Trainer

log = logging.getLogger("gpupar")


def build_trainer(config, task, mode, cluster=None) -> Trainer:
    """Sets up a run of `task` as config says, whatever the mode: the one set-up, which makes the Trainer once.

    Args:
      config: The run's options.
      task: What to train (gpupar.training.task.Task).
      mode: The mode (gpupar.training.modes.checked).
      cluster: The cluster (gpupar.runtime.cluster) of a multi-worker or parameter-server run.

    Returns:
      The Trainer, its input not started yet (Trainer.start).

    Raises:
      GpuparError: bad devices, data, model, loss or metrics, found before any training step.
    """
    step_options, loop = config.step, config.loop
    mode.refuse_task(task)
    _refuse_accumulation(task.train, step_options)
    devices, placement = _placed(config.device_setup, cluster, task, mode)
    step_options = _precision_resolved(step_options, placement, mode, task)
    if step_options.precision == "mixed_float16" and not placement.on_gpus:
        log.warning("precision=mixed_float16 without a GPU: the CPU emulates much of float16 math; "
                    "mixed_bfloat16 is the CPU's mixed precision")
    if task.seeded:
        keras.utils.set_random_seed(config.seed)

    train, evaluation = task.train, task.evaluation
    for adapter in (train, evaluation):
        if adapter is not None:
            adapter.prepare(config.input, config.seed)
    log.info("data: %s%s", train.description, f"; evaluation: {evaluation.description}" if evaluation else "")
    if train.resume_note and config.outputs.resume is not False:
        log.info("resume: %s", train.resume_note)
    per_step = train.batch_size(config.input, placement.replicas)
    global_batch = per_step * step_options.accumulate_steps  # examples per update
    steps_per_epoch = _steps_per_epoch(loop, train, global_batch, placement)
    eval_batch = config.input.validation_batch_size or per_step
    model, placement, compiled, variables, optimizer, update_optimizer = _model_and_optimizer(
        step_options, task, mode, placement, train)
    keras_seeds = global_seed_generator(placement.strategy)  # unseeded keras.random draws, shared by the replicas
    step_options, loop = _with_compile_options(step_options, loop, compiled)
    step_options = _jit_resolved(step_options, model, mode.jit_refusal(placement))
    if placement.on_gpus and fall_back_from_xla(model, xla_batch_norm_error(placement.devices[0])):
        log.warning("XLA could not compile the batch norm on %s, so it runs as Keras' BatchNormalization (the same "
                    "variables, slower): CUDA's ptxas and libdevice are missing; pip install 'tensorflow[and-cuda]' "
                    "brings them", placement.devices[0])
    if compiled.own_step:
        step = mode.own_step(model, train, evaluation, placement, global_batch, eval_batch,
                             config.input.validation_steps, step_options.jit_compile)
        log.info(own_step_note(model))
    else:
        objective = _checked_objective(compiled, model, train)
        step = mode.step(model, objective, optimizer, update_optimizer, variables, step_options, placement)
    _compiled_for_keras(model, compiled, update_optimizer, placement)
    _log_batch(per_step, placement, step_options, train)
    _log_step_options(step_options)
    return Trainer(
        placement=placement, model=model, optimizer=optimizer,
        loss_scale=update_optimizer if _scales_the_loss(update_optimizer, step_options) else None, step=step,
        calls=mode.calls(step, placement), make_input=mode.make_input(train, placement, global_batch),
        evaluate=mode.evaluation(step, evaluation, placement, eval_batch, config.input.validation_steps),
        weights_finite=finite_check(model), global_batch=global_batch, steps_per_epoch=steps_per_epoch,
        steps_per_call=_steps_per_call(loop, mode, steps_per_epoch),
        signature=task.signature or _signature(model),
        learning_rate=None if compiled.optimizer is not None else step_options.learning_rate,
        visible_gpus=devices.visible_gpus, given_model=task.model if task.model is not model else None,
        random_state=(keras_seeds.state,))


def _scales_the_loss(optimizer, step_options) -> bool:
    """Whether the optimizer is a loss-scale optimizer of mixed_float16 (not nan_policy=skip's, reset every call)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and step_options.nan_policy != "skip"


_HINTED = set()  # the faster formats the log has pointed out in this process


def _precision_resolved(step_options, placement, mode, task):
    """The step options with precision=auto made the fastest format these devices train as well in, said in the log.

    float32 where the mode's step is its own or the model is built already (its own dtype policy
    stands), and where auto's float16 would meet nan_policy=skip. A float32 run on devices with a
    faster format says so, once per process, as model.fit keeps float32 unless asked.
    """
    plan = machine_precision([d for d in placement.devices if d.startswith("/gpu")])
    if step_options.precision == "float32":
        if plan.fast and plan.precision not in _HINTED:
            _HINTED.add(plan.precision)
            log.info("precision: float32, as model.fit's; these devices train faster in %s (%s): pass precision=%r "
                     "or 'auto'", plan.precision, plan.reason, plan.precision)
        return step_options
    if step_options.precision != "auto":
        return step_options
    if not mode.takes_step_options or task.model is not None:
        plan = PrecisionPlan("float32", f"strategy={mode.name} computes in float32" if task.model is None
                             else "the model is built already, in its own dtype policy")
    elif plan.precision == "mixed_float16" and step_options.nan_policy == "skip":
        plan = PrecisionPlan("float32", "mixed_float16's loss scaling already skips steps, and nan_policy=skip asks it")
    log.info("precision: auto chose %s: %s", plan.precision, plan.reason)
    return dataclasses.replace(step_options, precision=plan.precision)


def _steps_per_call(loop, mode, steps_per_epoch: int) -> int:
    """Steps in one call: steps_per_call given, else the mode's own (parameter servers: 1, even for auto, whose
    calls are scheduled), else the loop options' (for auto, the most the loop's tuner may pick)."""
    if isinstance(loop.steps_per_call, int):
        return loop.steps_per_call
    return mode.steps_per_call or loop.steps_in_a_call(steps_per_epoch)


def _refuse_accumulation(train, step_options):
    """Refuses accumulate_steps for data whose batches are their own (it makes each replica's batch N times larger)."""
    accumulate = step_options.accumulate_steps
    if train.own_batches and accumulate > 1:
        raise GpuparError(f"accumulate_steps={accumulate} makes each replica's batch {accumulate} times larger, and "
                          f"{train.form}'s batches are its own: give arrays or an unbatched dataset, or make its "
                          "batches larger and use accumulate_steps=1")


def _jit_resolved(step_options, model, refusal):
    """The step options with jit_compile off where the mode's placement or a layer of the model cannot take XLA."""
    if not step_options.jit_compile:
        return step_options
    unsupported = [layer.name for layer in model._flatten_layers() if not getattr(layer, "supports_jit", True)]
    if unsupported and not refusal:
        refusal = (f"jit_compile: layer {unsupported[0]} cannot be compiled by XLA (as Keras' own fit decides from "
                   "Layer.supports_jit), so the step runs without XLA")
    if refusal:
        log.info(refusal)
        return dataclasses.replace(step_options, jit_compile=False)
    return step_options


def _placed(device_setup, cluster, task, mode):
    """(the DevicePlan, the mode's Placement): devices configured and the strategy made, both logged.

    Raises:
      TensorFlowStarted: TensorFlow ran before it could be set up, naming what in the task started it.
    """
    try:
        devices = configure_devices(device_setup)
        placement = mode.place(device_setup, cluster)
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
    steps = train.steps_per_epoch(global_batch, placement.replicas // placement.input_pipelines)
    if loop.steps_per_epoch is not None:
        steps = min(steps or loop.steps_per_epoch, loop.steps_per_epoch)
    elif steps is None:  # one pass per epoch, as Keras runs data of unknown length
        steps = train.counted_steps(global_batch)
        if steps is not None:
            log.info("data: %s: their length was unknown, so one pass was counted before training; an epoch is "
                     "%d steps", train.description, steps)
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


def _with_compile_options(step, loop, compiled: Compiled):
    """(StepOptions, LoopOptions) with compile's jit_compile and steps_per_execution, where the options leave them."""
    if compiled.jit_compile and not step.jit_compile:
        step = dataclasses.replace(step, jit_compile=True)
    if compiled.steps_per_execution > 1 and loop.steps_per_call is None:
        loop = dataclasses.replace(loop, steps_per_call=compiled.steps_per_execution)
    return step, loop


def _model_and_optimizer(step, task, mode, placement, train):
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
    trainer (keras/src/backend/tensorflow/trainer.py sets it when a model is made; tests/test_keras_native.py checks it).
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
    replicas = placement.replicas
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
    all_labels = objective.labels(y if all_labels is None else all_labels)  # every label where they are in memory
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
