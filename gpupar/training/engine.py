"""One run's set-up, whatever the mode: devices, placement, data, model, optimizer, and what the loop drives.

`build_engine` does the set-up that every mode shares, in one place, and a small builder per
mode adds that mode's step, evaluation and input: synchronous data parallelism (every
tf.distribute strategy but parameter servers), a model-parallel pipeline, and parameter servers.
Training (gpupar.training.run) and `gpupar diagnose` (gpupar.monitor.diagnose) build the same
engine, so diagnose measures the step and the pipeline that training would run.
"""

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from gpupar.config import PARAMETER_SERVERS, PIPELINE, SYNCHRONOUS, run_mode
from gpupar.data.sources import ARRAYS, DATASET_FN
from gpupar.errors import GpuparError, TensorFlowStarted
from gpupar.models.layers import fall_back_from_xla, replica_consistent_state, xla_batch_norm_error
from gpupar.models.staged import build_on_stages
from gpupar.runtime.devices import configure_devices
from gpupar.runtime.stages import plan_stages
from gpupar.runtime.strategy import SHARD_BYTES, build_strategy, check_jit_compile, detected_plan, max_shards
from gpupar.runtime.teardown import keep_for_process
from gpupar.training import parameter_server
from gpupar.training import pipeline as model_parallel
from gpupar.training.objective import Objective
from gpupar.training.steps import (Results, make_evaluate_function, make_evaluation, make_finite_check,
                                   make_train_function, timed_loop_iterations, unpack)

log = logging.getLogger("gpupar")


@dataclasses.dataclass
class Engine:
    """Everything the loop needs for one run, whatever the mode.

    Attributes:
      description: The one-line description of the placement (strategy, devices, replicas).
      strategy: The tf.distribute.Strategy (the StagePlan for a pipeline).
      replicas: Data-parallel replicas (parameter servers: workers).
      model: The Keras model.
      optimizer: The optimizer whose state checkpoints hold (inside any loss-scale wrapper).
      update_optimizer: What applies the updates: optimizer, or a loss-scale optimizer around it
        (precision=mixed_float16, nan_policy=skip).
      objective: The loss and metrics (gpupar.training.objective.Objective).
      global_batch: Examples per step (parameter servers: one worker's step).
      steps_per_epoch: Steps in one epoch (capped by config.steps_per_epoch).
      steps_per_call: Steps the loop asks for in one call, unless a boundary cuts it.
      make_input: make_input(first_step, limit=None) -> the training input from that global step.
      run_steps: run_steps(input, num_steps, first_call) -> Results of the steps that finished:
        synchronous and pipeline engines run num_steps; parameter servers schedule them and report
        the calls that finished meanwhile.
      finish: finish() -> Results of the steps still in flight, once applied (parameter servers).
      evaluate: evaluate() -> {"val_loss": ..., "val_<metric>": ...} of the current weights over the whole
        evaluation set ({} without one).
      weights_finite: weights_finite() -> whether every float weight is finite.
      signature: The model and its shape-defining options, as checkpoints record them.
      learning_rate: The learning rate to put back after restoring a checkpoint, or None.
      visible_gpus: The physical GPUs in use (for the utilisation sampler).
      on_gpus: Whether the compute devices are GPUs.
      updates: The optimizer's update counter (it stands still on a skipped step).
      input_pipelines: Input pipelines of the strategy: one per worker.
      stage_of: The pipeline stage of each layer of a chain model (model_parallel), else None.
      updated_variables: What the optimizer updates: the trainable variables, or their shards
        where a variable is split over parameter servers.
    """

    description: str
    strategy: Any
    replicas: int
    model: Any
    optimizer: Any
    update_optimizer: Any
    objective: Any
    global_batch: int
    steps_per_epoch: int
    steps_per_call: int
    make_input: Callable
    run_steps: Callable[..., Results]
    evaluate: Callable[[], dict]
    weights_finite: Callable[[], bool]
    signature: dict
    finish: Callable[[], Results] = Results
    learning_rate: Optional[float] = None
    visible_gpus: Sequence[int] = ()
    on_gpus: bool = False
    updates: Any = None
    input_pipelines: int = 1
    stage_of: Optional[Sequence[int]] = None
    updated_variables: Sequence = ()
    input: Any = None

    def start(self, first_step: int):
        """Starts the training input at a global step (after restoring), kept for the process."""
        self.input = self.make_input(first_step)

    def train(self, num_steps: int, first_call: bool = False) -> Results:
        """Runs (or schedules) num_steps steps on the started input."""
        return self.run_steps(self.input, num_steps, first_call)

    def run_calls(self, iterator, steps: int, first_call: bool = False) -> Results:
        """Runs `steps` steps from `iterator` in calls of steps_per_call, as training does; their summed results.

        For measurements (gpupar diagnose, the benchmarks): the training loop cuts its calls at
        checkpoint and profile boundaries too.
        """
        total, done = Results(), 0
        while done < steps:
            num = min(self.steps_per_call, steps - done)
            total += self.run_steps(iterator, num, first_call and done == 0)
            done += num
        return total


@dataclasses.dataclass
class _Placement:
    """Where a mode puts its replicas and variables: what build_engine needs before the model."""

    description: str
    strategy: Any
    replicas: int
    batch_replicas: int  # replicas that share one step's global batch
    scope: Callable[[], Any]
    devices: Sequence[str]
    stage_devices: Optional[Sequence[str]] = None  # a pipeline's: where each stage's variables live
    stage_ends: Optional[Sequence] = None  # a pipeline's: where its stages end
    pipelines: int = 1  # input pipelines: one per worker
    # model -> (the variables the optimizer updates, a log line per variable split over ps tasks)
    update_variables: Callable = lambda model: (model.trainable_variables, [])


def _place_synchronous(config, cluster, task):
    plan = detected_plan(config.strategy, config.devices, config.cross_device_ops, max_cpus=config.virtual_cpus or 1,
                         cluster=cluster)
    check_jit_compile(config.jit_compile, plan)
    strategy = build_strategy(plan)  # a multi-worker strategy must come before any other TensorFlow work
    workers = plan.cluster.num_workers if plan.kind == "multi_worker_mirrored" else 1
    return _Placement(plan.describe(), strategy, plan.num_replicas, plan.num_replicas, strategy.scope, plan.devices,
                      pipelines=workers)


def _place_pipeline(config, cluster, task):
    ends = config.stages or task.stage_ends
    if ends is None:
        raise GpuparError("strategy=model_parallel needs stages: the layers after which a new stage starts, by name or "
                          "index, e.g. stages=('conv_out',) for two stages")
    devices = detected_plan("auto", config.devices, max_cpus=config.virtual_cpus or 1).devices
    plan = plan_stages(devices, len(ends) + 1)
    description = (f"{plan.describe()}; {config.microbatches} micro-batch(es) of "
                   f"{config.batch_size // config.microbatches} per replica")
    return _Placement(description, plan, plan.num_replicas, plan.num_replicas, contextlib.nullcontext, devices,
                      plan.variable_devices, tuple(ends))


def _place_parameter_servers(config, cluster, task):
    plan = detected_plan(config.strategy, config.devices, config.cross_device_ops, cluster=cluster)
    strategy = build_strategy(plan, config.ps_shards)
    shards = max_shards(plan.cluster.num_ps, config.ps_shards)
    log.info("variables: on %d ps task(s); %s", plan.cluster.num_ps,
             f"those of {SHARD_BYTES // 1024} KiB or more split into up to {shards} shards" if shards > 1
             else "each one whole")
    # Each step trains one worker's batch, on its own.
    return _Placement(plan.describe(), strategy, plan.num_replicas, 1, strategy.scope, plan.devices,
                      update_variables=parameter_server.update_variables)


def build_engine(config, task, cluster=None) -> Engine:
    """Sets up a run of `task` as config says: the one set-up of every mode, then the mode's own parts.

    Args:
      config: The run's options.
      task: What to train (gpupar.training.task.Task).
      cluster: The cluster (gpupar.runtime.cluster) of a multi-worker or parameter-server run.

    Returns:
      The Engine, its input not started yet (Engine.start).

    Raises:
      GpuparError: bad devices, data, model, loss or metrics, found before any training step.
    """
    mode = run_mode(config, cluster)
    if mode == PARAMETER_SERVERS and not task.per_worker_input:
        raise GpuparError(f"strategy=parameter_server needs train_data as a dataset_fn(input_context), not "
                          f"{task.train_form}: each worker makes its own input pipeline with it (arrays or a dataset "
                          "made here would be copied into every worker's graph)")
    devices, placement = _placed(config, cluster, task, mode)
    on_gpus = any(d.startswith("/gpu") for d in placement.devices)
    if config.precision == "mixed_float16" and not on_gpus:
        log.warning("precision=mixed_float16 without a GPU: the CPU emulates much of float16 math; "
                    "mixed_bfloat16 is the CPU's mixed precision")
    keras.utils.set_random_seed(config.seed)

    train, evaluation = task.sources()
    log.info("data: %s%s", train.description, f"; evaluation: {evaluation.description}" if evaluation else "")
    if train.resume_note and config.resume is not False:
        log.info("resume: %s", train.resume_note)
    global_batch = config.batch_size * placement.batch_replicas * config.accumulate_steps  # examples per update
    steps_per_epoch = _steps_per_epoch(config, train, global_batch, placement)
    model, stage_of, updated, inner, applied = _model_and_optimizer(config, task, placement, train)
    if on_gpus and fall_back_from_xla(model, xla_batch_norm_error(placement.devices[0])):
        log.warning("XLA could not compile the batch norm on %s, so it runs as Keras' BatchNormalization (the same "
                    "variables, slower): CUDA's ptxas and libdevice are missing; pip install 'tensorflow[and-cuda]' "
                    "brings them", placement.devices[0])
    objective = _checked_objective(task, model, train)
    model.optimizer = applied  # where Keras' callbacks (ReduceLROnPlateau, LearningRateScheduler) look for it
    _log_step_options(config, global_batch)

    engine = Engine(
        description=placement.description, strategy=placement.strategy, replicas=placement.replicas, model=model,
        optimizer=inner, update_optimizer=applied, objective=objective, global_batch=global_batch,
        steps_per_epoch=steps_per_epoch, steps_per_call=config.steps_in_a_call(steps_per_epoch), make_input=None,
        run_steps=None, evaluate=None, weights_finite=make_finite_check(model),
        signature=task.signature or _signature(model),
        learning_rate=None if task.optimizer is not None else config.learning_rate, visible_gpus=devices.visible_gpus,
        on_gpus=on_gpus, updates=inner.iterations, input_pipelines=placement.pipelines, stage_of=stage_of,
        updated_variables=updated,
    )
    _BUILDERS[mode](engine, config, task, train, evaluation)
    return engine


def _placed(config, cluster, task, mode):
    """(the DevicePlan, the mode's _Placement): devices configured and the strategy made, both logged.

    Raises:
      TensorFlowStarted: TensorFlow ran before it could be set up, naming what in the task started it.
    """
    try:
        devices = configure_devices(config)
        placement = _PLACEMENTS[mode](config, cluster, task)
    except TensorFlowStarted as e:
        if not task.early_start:
            raise
        raise TensorFlowStarted(f"{e}. Here TensorFlow was started by {task.early_start}") from None
    if devices.intra_op_threads or devices.inter_op_threads:
        log.info("threads: %s per op, %s ops at once",
                 *(n or "TensorFlow's default" for n in (devices.intra_op_threads, devices.inter_op_threads)))
    log.info(placement.description)
    return devices, placement


def _steps_per_epoch(config, train, global_batch: int, placement) -> int:
    """Steps in one epoch: a pass over the training data, capped by config.steps_per_epoch."""
    # A dataset_fn's per-replica batches: each input pipeline gives those of its replicas that share a step.
    steps = train.steps_per_epoch(global_batch, placement.batch_replicas // placement.pipelines)
    if config.steps_per_epoch is not None:
        steps = min(steps or config.steps_per_epoch, config.steps_per_epoch)
    if steps is None:
        raise GpuparError(f"the training data ({train.description}) have no known length, so an epoch has none; "
                          "pass steps_per_epoch")
    return steps


def _model_and_optimizer(config, task, placement, train):
    """(model, stage of each layer or None, variables updated, optimizer, optimizer that applies updates).

    Both are made under the placement's scope, the model's layers in the run's dtype policy.
    """
    previous_policy = keras.config.dtype_policy()
    if config.precision != "float32":
        keras.config.set_dtype_policy(config.precision)  # the user's layers compute in 16 bits, weights stay float32
    try:
        with placement.scope():
            with replica_consistent_state():  # the model's state only: the optimizer's keeps Keras' aggregation
                model, stage_of = _built_model(task, placement, train)
            updated, split = placement.update_variables(model)
            inner = _optimizer(task.optimizer, config)
            applied = _loss_scaled(inner, config)
            applied.build(updated)  # each slot variable is placed beside its variable
    finally:
        keras.config.set_dtype_policy(previous_policy)
    for line in split:
        log.info("variable %s", line)
    return model, stage_of, updated, inner, applied


def _log_step_options(config, global_batch: int):
    """One line for each option that changes the step: accumulation, augmentation, precision and XLA."""
    if config.accumulate_steps > 1:
        log.info("accumulation: each update adds the gradients of %d batches of %d per replica, one after another, "
                 "then all-reduces once: one step on a global batch of %d", config.accumulate_steps,
                 config.batch_size, global_batch)
    if config.augment:
        log.info("augmentation: random shifts, rotations and zooms, on the %s", config.augment_on)
    if config.precision != "float32" or config.jit_compile:
        log.info("step: %s%s", config.precision, ", compiled with XLA" if config.jit_compile else "")


def _built_model(task, placement, train):
    """(the task's model, built; the stage of each of its layers for a pipeline, else None).

    A pipeline's model has each stage's variables on its device (gpupar.models.staged).
    """
    if placement.stage_devices is not None:
        return build_on_stages(task.build_model, placement.stage_ends, placement.stage_devices)
    model = task.build_model()
    if not model.built:  # a subclassed model makes its variables on its first call
        model(unpack(tuple(train.sample()))[0], training=False)
    return model, None


def _optimizer(given, config):
    """The optimizer to train with, made under the strategy's scope (Keras' optimizers must be)."""
    if given is None:
        return keras.optimizers.Adam(config.learning_rate)
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


def _loss_scaled(inner, config):
    if config.precision == "mixed_float16":  # scales the loss so float16 gradients neither vanish nor overflow
        return keras.optimizers.LossScaleOptimizer(inner)
    if config.nan_policy == "skip":
        # Keras' loss-scale optimizer is what skips non-finite steps. Its scale starts at 1, halves
        # on a skipped step (the engine puts it back to 1 after every call) and never grows; powers
        # of two scale float32 exactly.
        return keras.optimizers.LossScaleOptimizer(inner, initial_scale=1.0, dynamic_growth_steps=2**31 - 1)
    return inner


def _signature(model) -> dict:
    """What a checkpoint records of a model it did not get a preset's options for (Keras numbers its names)."""
    return {"model": type(model).__name__, "variables": len(model.weights), "parameters": int(model.count_params())}


def _checked_objective(task, model, train):
    """The Objective for the model's outputs, after the checks that need the model and one batch.

    Raises:
      GpuparError: labels outside the model's output range, a loss of one scalar per batch, a
        metric whose state does not add up, names that do not fit the outputs.
    """
    x, y, sample_weight = unpack(tuple(train.sample()))
    y_pred = tf.nest.map_structure(lambda t: np.asarray(t, np.float32), model(x, training=False))
    objective = Objective(task.loss, task.metrics, y, y_pred, getattr(model, "output_names", None))
    all_labels = train.data[1] if train.kind == ARRAYS else y  # every label where they are in memory
    for term in objective.losses:
        if term.sparse:
            labels = np.asarray(all_labels if term.key is None else all_labels[term.key])
            classes = (y_pred if term.key is None else y_pred[term.key]).shape[-1]
            if labels.size and (labels.min() < 0 or labels.max() >= classes):
                raise GpuparError(f"the labels reach {labels.min()}..{labels.max()}, but the model has {classes} "
                                  f"outputs (classes 0..{classes - 1}); fix the labels or the model's last layer")
    objective.terms(y, y_pred, sample_weight)  # refuses a loss of one scalar per batch
    objective.check_additive(y, y_pred, sample_weight)
    objective.reset()
    return objective


def _timed_calls(train, loss_scale=None):
    """run_steps for a train function of steps_in_one_call(timed=True)."""

    def run_steps(iterator, num_steps, first_call):
        (loss, states), waited, busy = train(iterator, tf.constant(num_steps), tf.constant(first_call))
        if loss_scale is not None:
            loss_scale.assign(1.0)  # nan_policy=skip: each skipped step halved it
        return Results(num_steps, float(loss), [s.numpy() for s in states], float(waited), float(busy))

    return run_steps


def _no_evaluation():
    return {}


def _synchronous(engine: Engine, config, task, train, evaluation):
    """Every replica steps together; the gradients are all-reduced in the optimizer's update."""
    if train.kind == DATASET_FN and config.accumulate_steps > 1:
        raise GpuparError(f"accumulate_steps={config.accumulate_steps} makes each replica's batch {config.accumulate_steps} "
                          "times larger, and a dataset_fn's batches are its own: give arrays, a dataset or a TFDS name, "
                          "or batch the dataset_fn larger and use accumulate_steps=1")
    strategy, optimizer, skips = engine.strategy, engine.update_optimizer, config.nan_policy == "skip"
    train_function = make_train_function(strategy, engine.model, optimizer, engine.objective, skips,
                                         task.device_transform, config.jit_compile, config.accumulate_steps,
                                         timed_loop_iterations(engine.on_gpus))
    engine.run_steps = _timed_calls(train_function, optimizer.dynamic_scale if skips else None)
    per_pipeline = engine.replicas // engine.input_pipelines

    def make_input(first_step, limit=None):
        if train.kind == DATASET_FN:  # per-replica batches: a pipeline gives per_pipeline of them a step
            def replica_batches(context):
                dataset = train.data(context).repeat().skip(first_step * per_pipeline)
                return dataset if limit is None else dataset.take(limit * per_pipeline)

            return keep_for_process(iter(strategy.distribute_datasets_from_function(replica_batches)))
        dataset = train.training(engine.global_batch, config.seed, first_step, limit, config)
        return keep_for_process(iter(strategy.experimental_distribute_dataset(dataset)))

    engine.make_input = make_input
    if evaluation is None:
        engine.evaluate = _no_evaluation
        return
    if evaluation.kind == DATASET_FN:
        if evaluation.batches % per_pipeline:
            raise GpuparError(f"eval_data's dataset_fn gives {evaluation.batches} batches per input pipeline, not a "
                              f"multiple of its {per_pipeline} replicas, so a last step would take batches of the "
                              "next pass; drop or pad the last batches, or give the evaluation set as arrays or a "
                              "dataset (gpupar splits a last partial batch itself)")
        dataset = strategy.distribute_datasets_from_function(lambda context: evaluation.data(context).repeat())
        steps = evaluation.batches // per_pipeline
    else:
        dataset, steps = evaluation.evaluation(engine.global_batch // config.accumulate_steps)
        dataset = strategy.experimental_distribute_dataset(dataset)
    engine.evaluate = make_evaluation(make_evaluate_function(strategy, engine.model, engine.objective),
                                      keep_for_process(iter(dataset)), steps, engine.objective, engine.model)


def _pipeline(engine: Engine, config, task, train, evaluation):
    """The model's stages on consecutive devices, each batch pipelined as micro-batches."""
    for role, source in (("train_data", train), ("eval_data", evaluation)):
        if source is not None and source.kind == DATASET_FN:
            raise GpuparError(f"{role} is a dataset_fn, which gives per-replica batches; strategy=model_parallel "
                              "splits each global batch itself: give arrays, a dataset or a TFDS name")
    stages = model_parallel.Pipeline(engine.model, engine.stage_of, engine.strategy, engine.objective,
                                     config.microbatches)
    for line in stages.describe():
        log.info(line)
    engine.run_steps = _timed_calls(model_parallel.make_train_function(stages, engine.optimizer,
                                                                       timed_loop_iterations(engine.on_gpus)))
    engine.make_input = lambda first_step, limit=None: keep_for_process(iter(
        train.training(engine.global_batch, config.seed, first_step, limit, config)))
    if evaluation is None:
        engine.evaluate = _no_evaluation
        return
    dataset, steps = evaluation.evaluation(engine.global_batch)
    engine.evaluate = make_evaluation(model_parallel.make_evaluate_function(stages), keep_for_process(iter(dataset)),
                                      steps, engine.objective, engine.model)


def _parameter_servers(engine: Engine, config, task, train, evaluation):
    """Workers step asynchronously on variables that live on the parameter servers; the chief schedules and evaluates."""
    strategy, num_workers = engine.strategy, engine.replicas
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    scheduler = parameter_server.Scheduler(coordinator, parameter_server.make_worker_step(
        strategy, engine.model, engine.update_optimizer, engine.objective, engine.updated_variables), num_workers)
    engine.run_steps = lambda iterator, num_steps, first_call: scheduler.schedule(iterator, num_steps)
    engine.finish = scheduler.finish
    # Unless told otherwise, a call per step: an epoch spreads evenly over the workers.
    engine.steps_per_call = config.steps_per_call or 1

    def make_input(first_step, limit=None):
        if train.kind == DATASET_FN and first_step:
            log.info("resume: each worker's pipeline skips %d batches, its share of the %d steps already trained "
                     "(which worker trained which is not recorded)", first_step // num_workers, first_step)

        def worker_dataset(context):
            if train.kind == DATASET_FN:  # this worker's own pipeline
                dataset = train.data(context).repeat().skip(first_step // num_workers)
                return dataset if limit is None else dataset.take(limit)
            # The preset's arrays: this worker's shard of the seeded batch order, from where the checkpoint left off.
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            return train.training(engine.global_batch, config.seed, first_step, limit, config).shard(num_workers,
                                                                                                   worker)

        return keep_for_process(iter(coordinator.create_per_worker_dataset(
            tf.function(lambda: strategy.distribute_datasets_from_function(worker_dataset)))))

    engine.make_input = make_input
    if evaluation is None:
        engine.evaluate = _no_evaluation
        return
    log.info("evaluation: on the chief, reading the variables from the ps tasks")
    dataset, steps = evaluation.evaluation(engine.global_batch)
    engine.evaluate = make_evaluation(make_evaluate_function(None, engine.model, engine.objective),
                                      keep_for_process(iter(dataset)), steps, engine.objective, engine.model)


_PLACEMENTS = {SYNCHRONOUS: _place_synchronous, PIPELINE: _place_pipeline, PARAMETER_SERVERS: _place_parameter_servers}
_BUILDERS = {SYNCHRONOUS: _synchronous, PIPELINE: _pipeline, PARAMETER_SERVERS: _parameter_servers}
