"""What every run builds before its first step: devices, strategy, data, model, optimizer, input.

Training (gpupar.train) and `gpupar diagnose` (gpupar.diagnose) assemble the same parts, so
that diagnose measures the step and the pipeline that training would run.
"""

import dataclasses
import logging
from typing import Any, Optional

import keras

from gpupar import data
from gpupar.config import Config
from gpupar.errors import GpuparError
from gpupar.devices import DevicePlan, configure_devices
from gpupar.idx import Splits
from gpupar.model import build_model
from gpupar.strategy import Plan, build_strategy, detected_plan
from gpupar.teardown import keep_for_process

log = logging.getLogger("gpupar")


@dataclasses.dataclass
class Assembly:
    """A run's devices, strategy, data, model and optimizer (built under the strategy's scope).

    Attributes:
      devices: The device settings applied to the runtime (visible GPUs, memory, virtual CPUs).
      plan: The strategy decision and its reason.
      strategy: The tf.distribute.Strategy built from the plan.
      splits: The training and test images in memory.
      global_batch: Examples per step over all replicas.
      steps_per_epoch: Steps in one epoch (capped by config.steps_per_epoch).
      model: The ConvNet.
      adam: The Adam optimizer, whose state the checkpoints hold.
      optimizer: What applies the updates: adam, or a loss-scale optimizer around it (nan_policy=skip,
        precision=mixed_float16).
      augment_seed: Seed of the on-device augmentation; None when the step does not augment.
      jit_compile: Whether each replica's step is compiled with XLA.
    """

    devices: DevicePlan
    plan: Plan
    strategy: Any
    splits: Splits
    global_batch: int
    steps_per_epoch: int
    model: Any
    adam: Any
    optimizer: Any
    augment_seed: Optional[int]
    jit_compile: bool = False
    skips_nonfinite: bool = False  # nan_policy=skip: a non-finite step is dropped and counted


def assemble(config: Config, cluster=None) -> Assembly:
    """Configures the devices, then builds the strategy, loads the data and builds the model.

    `cluster` (gpupar.cluster) makes it a multi-worker strategy, which must come before any op.
    """
    devices = configure_devices(config)
    if devices.intra_op_threads or devices.inter_op_threads:
        log.info("threads: %s per op, %s ops at once",
                 *(n or "TensorFlow's default" for n in (devices.intra_op_threads, devices.inter_op_threads)))
    plan = detected_plan(config.strategy, config.devices, config.cross_device_ops, max_cpus=config.virtual_cpus or 1,
                         cluster=cluster)
    log.info(plan.describe())
    if config.jit_compile and plan.num_replicas > 1:
        raise GpuparError(f"jit_compile needs one replica, and this run has {plan.num_replicas} (XLA cannot compile "
                          "tf.distribute's all-reduce and cross-replica updates); drop jit_compile or use one device")
    if config.precision == "mixed_float16" and not devices.visible_gpus:
        log.warning("precision=mixed_float16 without a GPU: the CPU emulates much of float16 math; "
                    "mixed_bfloat16 is the CPU's mixed precision")
    strategy = build_strategy(plan)
    keras.utils.set_random_seed(config.seed)

    splits = data.load_splits(config.dataset, config.data_dir)
    log.info("data: %d training and %d test images from %s", len(splits.train_labels), len(splits.test_labels),
             config.data_dir or f"TFDS {config.dataset}")
    global_batch = config.batch_size * strategy.num_replicas_in_sync
    steps_per_epoch = data.batches_per_epoch(len(splits.train_images), global_batch)
    if config.steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, config.steps_per_epoch)

    with strategy.scope():
        model = build_model(config)
        adam = keras.optimizers.Adam(config.learning_rate)
        if config.precision == "mixed_float16":  # scales the loss so float16 gradients neither vanish nor overflow
            optimizer = keras.optimizers.LossScaleOptimizer(adam)
        elif config.nan_policy == "skip":
            # Keras' loss-scale optimizer is what skips non-finite steps. Its scale starts at 1, halves
            # on a skipped step (the loop puts it back to 1 after every call) and never grows; powers
            # of two scale float32 exactly.
            optimizer = keras.optimizers.LossScaleOptimizer(adam, initial_scale=1.0, dynamic_growth_steps=2**31 - 1)
        else:
            optimizer = adam
        optimizer.build(model.trainable_variables)
    if config.augment:
        log.info("augmentation: random shifts, rotations and zooms, on the %s", config.augment_on)
    if config.precision != "float32" or config.jit_compile:
        log.info("step: %s%s", config.precision, ", compiled with XLA" if config.jit_compile else "")
    augment_seed = config.seed if config.augment and config.augment_on == "device" else None
    return Assembly(devices, plan, strategy, splits, global_batch, steps_per_epoch, model, adam, optimizer, augment_seed,
                    config.jit_compile, config.nan_policy == "skip")


def train_iterator(config: Config, run: Assembly, start_step: int = 0, limit: Optional[int] = None):
    """The distributed iterator over training batches from global step start_step, kept for the process.

    With `limit` it ends after that many batches, and its pipeline stops working then.
    """
    dataset = data.train_dataset(
        run.splits.train_images, run.splits.train_labels, run.global_batch, config.seed, start_step=start_step,
        augment_on_host=config.augment and config.augment_on == "host", num_parallel_calls=config.num_parallel_calls,
        deterministic=config.deterministic, threads=config.data_threads,
    )
    if limit is not None:
        dataset = dataset.take(limit)
    return keep_for_process(iter(run.strategy.experimental_distribute_dataset(dataset)))
