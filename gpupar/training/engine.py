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
import tensorflow as tf

from gpupar.config import PARAMETER_SERVERS, PIPELINE, SYNCHRONOUS, run_mode
from gpupar.data import mnist, pipeline
from gpupar.models.presets import build_model, model_signature, num_stages
from gpupar.runtime.devices import configure_devices
from gpupar.runtime.stages import plan_stages
from gpupar.runtime.strategy import build_strategy, check_jit_compile, detected_plan
from gpupar.runtime.teardown import keep_for_process
from gpupar.training import parameter_server
from gpupar.training import pipeline as model_parallel
from gpupar.training.steps import Results, make_evaluation, make_finite_check, make_test_function, make_train_function

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
      global_batch: Examples per step (parameter servers: one worker's step).
      steps_per_epoch: Steps in one epoch (capped by config.steps_per_epoch).
      steps_per_call: Steps the loop asks for in one call, unless a boundary cuts it.
      make_input: make_input(first_step, limit=None) -> the training input from that global step.
      run_steps: run_steps(input, num_steps, first_call) -> Results of the steps that finished:
        synchronous and pipeline engines run num_steps; parameter servers schedule them and report
        the calls that finished meanwhile.
      finish: finish() -> Results of the steps still in flight, once applied (parameter servers).
      evaluate: evaluate() -> test accuracy of the current weights over the whole test set.
      weights_finite: weights_finite() -> whether every float weight is finite.
      signature: The model and its shape-defining options, as checkpoints record them.
      learning_rate: The learning rate to put back after restoring a checkpoint, or None.
      visible_gpus: The physical GPUs in use (for the utilisation sampler).
      on_gpus: Whether the compute devices are GPUs.
      updates: The optimizer's update counter (it stands still on a skipped step).
    """

    description: str
    strategy: Any
    replicas: int
    model: Any
    optimizer: Any
    update_optimizer: Any
    global_batch: int
    steps_per_epoch: int
    steps_per_call: int
    make_input: Callable
    run_steps: Callable[..., Results]
    evaluate: Callable[[], float]
    weights_finite: Callable[[], bool]
    signature: dict
    finish: Callable[[], Results] = Results
    learning_rate: Optional[float] = None
    visible_gpus: Sequence[int] = ()
    on_gpus: bool = False
    updates: Any = None
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
    stage_devices: Optional[Sequence[str]] = None


def _place_synchronous(config, cluster):
    plan = detected_plan(config.strategy, config.devices, config.cross_device_ops, max_cpus=config.virtual_cpus or 1,
                         cluster=cluster)
    check_jit_compile(config.jit_compile, plan)
    strategy = build_strategy(plan)  # a multi-worker strategy must come before any other TensorFlow work
    return _Placement(plan.describe(), strategy, plan.num_replicas, plan.num_replicas, strategy.scope, plan.devices)


def _place_pipeline(config, cluster):
    devices = detected_plan("auto", config.devices, max_cpus=config.virtual_cpus or 1).devices
    plan = plan_stages(devices, num_stages(config))
    description = (f"{plan.describe()}; {config.microbatches} micro-batch(es) of "
                   f"{config.batch_size // config.microbatches} per replica")
    return _Placement(description, plan, plan.num_replicas, plan.num_replicas, contextlib.nullcontext, devices,
                      plan.variable_devices)


def _place_parameter_servers(config, cluster):
    plan = detected_plan(config.strategy, config.devices, config.cross_device_ops, cluster=cluster)
    strategy = build_strategy(plan)
    # Each step trains one worker's batch, on its own.
    return _Placement(plan.describe(), strategy, plan.num_replicas, 1, strategy.scope, plan.devices)


def build_engine(config, cluster=None, optimizer=None) -> Engine:
    """Sets up a run as config says: the one set-up of every mode, then the mode's own parts.

    `cluster` (gpupar.runtime.cluster) makes it a multi-worker or parameter-server run.
    `optimizer` replaces the default Adam(config.learning_rate); it is built under the strategy.
    """
    mode = run_mode(config, cluster)
    devices = configure_devices(config)
    if devices.intra_op_threads or devices.inter_op_threads:
        log.info("threads: %s per op, %s ops at once",
                 *(n or "TensorFlow's default" for n in (devices.intra_op_threads, devices.inter_op_threads)))
    placement = _PLACEMENTS[mode](config, cluster)
    log.info(placement.description)
    on_gpus = any(d.startswith("/gpu") for d in placement.devices)
    if config.precision == "mixed_float16" and not on_gpus:
        log.warning("precision=mixed_float16 without a GPU: the CPU emulates much of float16 math; "
                    "mixed_bfloat16 is the CPU's mixed precision")
    keras.utils.set_random_seed(config.seed)

    splits = mnist.load_splits(config.dataset, config.data_dir)
    log.info("data: %d training and %d test images from %s", len(splits.train_labels), len(splits.test_labels),
             config.data_dir or f"TFDS {config.dataset}")
    global_batch = config.batch_size * placement.batch_replicas
    steps_per_epoch = pipeline.batches_per_epoch(len(splits.train_images), global_batch)
    if config.steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, config.steps_per_epoch)

    with placement.scope():
        model = build_model(config, stage_devices=placement.stage_devices)
        inner = optimizer or keras.optimizers.Adam(config.learning_rate)
        if config.precision == "mixed_float16":  # scales the loss so float16 gradients neither vanish nor overflow
            applied = keras.optimizers.LossScaleOptimizer(inner)
        elif config.nan_policy == "skip":
            # Keras' loss-scale optimizer is what skips non-finite steps. Its scale starts at 1, halves
            # on a skipped step (the engine puts it back to 1 after every call) and never grows; powers
            # of two scale float32 exactly.
            applied = keras.optimizers.LossScaleOptimizer(inner, initial_scale=1.0, dynamic_growth_steps=2**31 - 1)
        else:
            applied = inner
        applied.build(model.trainable_variables)  # each slot variable is placed beside its variable
    if config.augment:
        log.info("augmentation: random shifts, rotations and zooms, on the %s", config.augment_on)
    if config.precision != "float32" or config.jit_compile:
        log.info("step: %s%s", config.precision, ", compiled with XLA" if config.jit_compile else "")

    engine = Engine(
        description=placement.description, strategy=placement.strategy, replicas=placement.replicas, model=model,
        optimizer=inner, update_optimizer=applied, global_batch=global_batch, steps_per_epoch=steps_per_epoch,
        steps_per_call=config.steps_in_a_call(steps_per_epoch), make_input=None, run_steps=None, evaluate=None,
        weights_finite=make_finite_check(model), signature=model_signature(config),
        learning_rate=None if optimizer else config.learning_rate, visible_gpus=devices.visible_gpus,
        on_gpus=on_gpus, updates=inner.iterations,
    )
    _BUILDERS[mode](engine, config, splits)
    return engine


def _timed_calls(train, loss_scale=None):
    """run_steps for a train function of steps_in_one_call(timed=True)."""

    def run_steps(iterator, num_steps, first_call):
        loss, correct, waited, busy = train(iterator, tf.constant(num_steps), tf.constant(first_call))
        if loss_scale is not None:
            loss_scale.assign(1.0)  # nan_policy=skip: each skipped step halved it
        return Results(num_steps, float(loss), float(correct), float(waited), float(busy))

    return run_steps


def _train_dataset(config, splits, global_batch, first_step, limit=None):
    dataset = pipeline.train_dataset(
        splits.train_images, splits.train_labels, global_batch, config.seed, start_step=first_step,
        augment_on_host=config.augment and config.augment_on == "host",
        num_parallel_calls=config.num_parallel_calls, deterministic=config.deterministic, threads=config.data_threads,
    )
    return dataset if limit is None else dataset.take(limit)


def _test_dataset(splits, global_batch):
    return pipeline.test_dataset(splits.test_images, splits.test_labels, global_batch)


def _synchronous(engine: Engine, config, splits):
    """Every replica steps together; the gradients are all-reduced in the optimizer's update."""
    strategy, optimizer, skips = engine.strategy, engine.update_optimizer, config.nan_policy == "skip"
    augment_seed = config.seed if config.augment and config.augment_on == "device" else None
    train = make_train_function(strategy, engine.model, optimizer, engine.global_batch, skips, augment_seed,
                                config.jit_compile)
    engine.run_steps = _timed_calls(train, optimizer.dynamic_scale if skips else None)

    def make_input(first_step, limit=None):
        dataset = _train_dataset(config, splits, engine.global_batch, first_step, limit)
        return keep_for_process(iter(strategy.experimental_distribute_dataset(dataset)))

    engine.make_input = make_input
    test_iterator = keep_for_process(iter(strategy.experimental_distribute_dataset(
        _test_dataset(splits, engine.global_batch))))
    engine.evaluate = make_evaluation(make_test_function(strategy, engine.model), test_iterator,
                                      pipeline.test_steps(len(splits.test_images), engine.global_batch))


def _pipeline(engine: Engine, config, splits):
    """The model's stages on consecutive devices, each batch pipelined as micro-batches."""
    stages = model_parallel.Pipeline(engine.model, engine.strategy, config.microbatches)
    for line in stages.describe():
        log.info(line)
    engine.run_steps = _timed_calls(model_parallel.make_train_function(stages, engine.optimizer,
                                                                       engine.global_batch))
    engine.make_input = lambda first_step, limit=None: keep_for_process(iter(
        _train_dataset(config, splits, engine.global_batch, first_step, limit)))
    test_iterator = keep_for_process(iter(_test_dataset(splits, engine.global_batch)))
    engine.evaluate = make_evaluation(model_parallel.make_test_function(stages), test_iterator,
                                      pipeline.test_steps(len(splits.test_images), engine.global_batch))


def _parameter_servers(engine: Engine, config, splits):
    """Workers step asynchronously on variables that live on the parameter servers; the chief schedules."""
    strategy, num_workers = engine.strategy, engine.replicas
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    scheduler = parameter_server.Scheduler(coordinator, parameter_server.make_worker_step(
        strategy, engine.model, engine.optimizer), num_workers)
    engine.run_steps = lambda iterator, num_steps, first_call: scheduler.schedule(iterator, num_steps)
    engine.finish = scheduler.finish
    # Unless told otherwise, a call per step: an epoch spreads evenly over the workers.
    engine.steps_per_call = config.steps_per_call or 1

    def make_input(first_step, limit=None):
        def worker_dataset(_context):
            # This worker's shard of the seeded batch order, from where the checkpoint left off.
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            return _train_dataset(config, splits, engine.global_batch, first_step, limit).shard(num_workers, worker)

        return keep_for_process(iter(coordinator.create_per_worker_dataset(
            tf.function(lambda: strategy.distribute_datasets_from_function(worker_dataset)))))

    engine.make_input = make_input
    test_iterator = keep_for_process(iter(_test_dataset(splits, engine.global_batch)))  # on the chief
    engine.evaluate = make_evaluation(parameter_server.make_test_function(engine.model), test_iterator,
                                      pipeline.test_steps(len(splits.test_images), engine.global_batch))


_PLACEMENTS = {SYNCHRONOUS: _place_synchronous, PIPELINE: _place_pipeline, PARAMETER_SERVERS: _place_parameter_servers}
_BUILDERS = {SYNCHRONOUS: _synchronous, PIPELINE: _pipeline, PARAMETER_SERVERS: _parameter_servers}
