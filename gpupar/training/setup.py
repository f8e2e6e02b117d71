"""One run's set-up, whatever the mode: devices, placement, data, model, optimizer, step; the Trainer, made once.

`build_trainer` does the set-up that every mode shares, in one place, handing each part of the
Config to the layer that reads it, asking the mode (gpupar.training.modes) for its parts (the
placement, the model's build, the calls, the input and the evaluation) and the model's kind of
step (gpupar.training.steps) for the step. Training
(gpupar.training.run) and `gpupar diagnose` build the same Trainer, so diagnose measures the
step and the pipeline that training would run.
"""

import dataclasses
import logging

import keras
import numpy as np

from gpupar.errors import GpuparError, TensorFlowStarted
from gpupar.models.layers import fall_back_from_xla, global_seed_generator, xla_batch_norm_error
from gpupar.runtime.devices import configure_devices
from gpupar.runtime.precision import PrecisionPlan, machine_precision
from gpupar import keras_compat
from gpupar.training.model_setup import Compiled, model_and_optimizer
from gpupar.training.steps import StepRequest
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
    step_options, loop = config.step_options, config.loop
    mode.refuse_task(task)
    _refuse_accumulation(task.train, step_options)
    devices, placement = _placed(config.device_setup, cluster, task, mode)
    step_options = _precision_resolved(step_options, placement, mode, task)
    if step_options.precision == "mixed_float16" and not placement.on_gpus:
        log.warning("precision=mixed_float16 without a GPU: the CPU emulates much of float16 math; "
                    "mixed_bfloat16 is the CPU's mixed precision")
    if task.seeded:
        keras.utils.set_random_seed(config.seed)

    train, validation = task.train, task.validation
    for adapter in (train, validation):
        if adapter is not None:
            adapter.prepare(config.input, config.seed)
    log.info("data: %s%s", train.description, f"; evaluation: {validation.description}" if validation else "")
    if train.resume_note and config.outputs.resume is not False:
        log.info("resume: %s", train.resume_note)
    per_step = train.batch_size(config.input, placement.replicas)
    global_batch = per_step * step_options.accumulate_steps  # examples per update
    steps_per_epoch = _steps_per_epoch(loop, train, global_batch, placement)
    eval_batch = config.input.validation_batch_size or per_step
    built = model_and_optimizer(step_options, task, mode, placement, train)
    model, placement, compiled, optimizer = built.model, built.placement, built.compiled, built.optimizer
    keras_seeds = global_seed_generator(placement.strategy)  # unseeded keras.random draws, shared by the replicas
    step_options, loop = _with_compile_options(step_options, loop, compiled)
    step_options = _jit_resolved(step_options, model, mode.jit_refusal(placement))
    if placement.on_gpus and fall_back_from_xla(model, xla_batch_norm_error(placement.devices[0])):
        log.warning("XLA could not compile the batch norm on %s, so it runs as Keras' BatchNormalization (the same "
                    "variables, slower): CUDA's ptxas and libdevice are missing; pip install 'tensorflow[and-cuda]' "
                    "brings them", placement.devices[0])
    step = built.kind.build(StepRequest(model, optimizer, built.update_optimizer, built.variables, step_options, mode,
                                        placement, train, validation, global_batch, eval_batch,
                                        config.input.validation_steps))
    step.run_eagerly = compiled.run_eagerly
    _log_batch(per_step, placement, step_options, train)
    _log_step_options(step_options)
    steps_per_call = _steps_per_call(loop, mode, steps_per_epoch)
    return Trainer(
        placement=placement, model=model, optimizer=optimizer,
        loss_scale=built.update_optimizer if _scales_the_loss(built.update_optimizer, step_options) else None,
        step=step,
        calls=mode.calls(step, placement, None if per_step % placement.replicas else per_step // placement.replicas),
        make_input=mode.make_input(train, placement, global_batch),
        evaluate=mode.make_evaluate(step, validation, placement, eval_batch, config.input.validation_steps,
                                 steps_per_call),
        weights_finite=finite_check(model), global_batch=global_batch, steps_per_epoch=steps_per_epoch,
        steps_per_call=steps_per_call,
        signature=task.signature or _signature(model),
        learning_rate=None if compiled.optimizer is not None else step_options.learning_rate,
        visible_gpus=devices.visible_gpus,
        global_random_state=(keras_seeds.state,), variables=built.variables)


def _scales_the_loss(optimizer, step_options) -> bool:
    """Whether the optimizer is a loss-scale optimizer of mixed_float16 (not nan_policy=skip's, reset every call)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and step_options.nan_policy != "skip"


_HINTED = set()  # the faster formats the log has pointed out in this process


def _precision_resolved(step_options, placement, mode, task):
    """The step options with precision=auto made the 16-bit format of these devices' matrix units, said in the log.

    float32 where the mode's step is its own or the model is built already (its own dtype policy
    stands), and where auto's float16 would meet nan_policy=skip. A float32 run on devices with a
    16-bit format says so, once per process, as model.fit keeps float32 unless asked.
    """
    plan = machine_precision([d for d in placement.devices if d.startswith("/gpu")])
    if step_options.precision == "float32":
        if plan.fast and plan.precision not in _HINTED:
            _HINTED.add(plan.precision)
            log.info("precision: float32, as model.fit's; %s, so %s may train faster (on large matrix products; "
                     "gpupar diagnose measures both on this model): pass precision=%r or 'auto' to try it",
                     plan.reason, plan.precision, plan.precision)
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
    unsupported = [layer.name for layer in keras_compat.all_layers(model) if not getattr(layer, "supports_jit", True)]
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


def _with_compile_options(options, loop, compiled: Compiled):
    """(StepOptions, LoopOptions) with compile's jit_compile and steps_per_execution, where the options leave them.

    run_eagerly, Keras' debugging mode, runs one step per call, without XLA, as model.fit does.
    """
    if compiled.run_eagerly:
        return dataclasses.replace(options, jit_compile=False), dataclasses.replace(loop, steps_per_call=1)
    if compiled.jit_compile and not options.jit_compile:
        options = dataclasses.replace(options, jit_compile=True)
    if compiled.steps_per_execution > 1 and loop.steps_per_call is None:
        loop = dataclasses.replace(loop, steps_per_call=compiled.steps_per_execution)
    return options, loop


def _log_batch(per_step: int, placement, options, train):
    """The batch line: the global batch, what each replica gets, and the examples of an update."""
    replicas = placement.replicas
    share = f"{per_step // replicas} per replica on {replicas} replicas" if replicas > 1 else "on one replica"
    if per_step % replicas:
        share = f"about {per_step / replicas:.1f} per replica on {replicas} replicas"
    own = f" ({train.form}'s own batches)" if train.own_batches else ""
    update = f"; {per_step * options.accumulate_steps} per update ({options.accumulate_steps} accumulated)" if \
        options.accumulate_steps > 1 else ""
    log.info("batch: %d examples per step%s, %s%s", per_step, own, share, update)


def _log_step_options(options):
    """One line for each option that changes the step: accumulation, precision and XLA."""
    if options.accumulate_steps > 1:
        log.info("accumulation: each update adds the gradients of %d micro-batches, one after another, then "
                 "all-reduces once: one step on their whole batch", options.accumulate_steps)
    if options.precision != "float32" or options.jit_compile:
        log.info("step: %s%s", options.precision, ", compiled with XLA" if options.jit_compile else "")


def _signature(model) -> dict:
    """What a checkpoint records of a model it did not get a preset's options for (Keras numbers its names)."""
    parameters = sum(int(np.prod(weight.shape)) for weight in model.weights)  # count_params() needs a built model
    return {"model": type(model).__name__, "variables": len(model.weights), "parameters": parameters}
