"""Model parallelism: one model's stages on consecutive devices, pipelined over micro-batches.

    gpupar --model=lstm --strategy=model_parallel --virtual_cpus=3 --microbatches=4 \
        --dataset=fashion_mnist --data_dir=/usr/share/datasets/fashion-mnist --epochs=2

The step is gpupar.training.steps.pipelined.PipelineStep (its kind applies to a placement of
stages); this mode plans the stages on the devices, builds the model with each stage's variables
on its device (gpupar.models.staged), and feeds each global batch whole to the pipeline.
"""

import tensorflow as tf

from gpupar.errors import GpuparError
from gpupar.models.staged import build_on_stages
from gpupar.runtime.stages import plan_stages
from gpupar.runtime.strategy import detected_plan
from gpupar.training.inner_loop import timed_loop_iterations
from gpupar.training.modes.mode import Mode
from gpupar.training.steps.step import LocalCalls
from gpupar.training.trainer import Placement


class ModelParallel(Mode):
    """strategy=model_parallel: a chain model's stages on consecutive devices, each batch pipelined as micro-batches."""

    name = "model_parallel"
    strategies = ("model_parallel",)
    options = {"microbatches": "pipelines the stages of", "stages": "splits a model for"}
    batch_norm = "normalises each micro-batch on its own (as GPipe does)"
    takes_built_model = False  # it builds the model itself, then moves each stage's variables

    def refuse(self, input_options):
        microbatches = self.distribution.microbatches
        for option in ("batch_size", "per_replica_batch_size"):
            batch = getattr(input_options, option)
            if batch is not None and batch % microbatches:
                raise GpuparError(f"{option}={batch} does not split into microbatches={microbatches} equal "
                                  f"micro-batches; choose a {option} that is a multiple of microbatches")

    def refuse_task(self, task):
        for adapter in (task.train, task.validation):
            if adapter is not None and adapter.per_replica_batches:
                raise GpuparError(f"{adapter.role} is {adapter.form}, which gives per-replica batches; "
                                  "strategy=model_parallel splits each global batch itself: give arrays, a dataset or "
                                  "a TFDS name")
        if self.distribution.stages is None:
            raise GpuparError("strategy=model_parallel needs stages: the layers after which a new stage starts, by name "
                              "or index, e.g. stages=('conv_out',) for two stages")

    def place(self, device_setup, cluster) -> Placement:
        distribution = self.distribution
        devices = detected_plan("auto", distribution.devices, max_cpus=device_setup.virtual_cpus or 1).devices
        plan = plan_stages(devices, len(distribution.stages) + 1)
        description = f"{plan.describe()}; {distribution.microbatches} micro-batch(es) per replica"
        # Each stage places its variables itself (tf.device): the default strategy's scope.
        return Placement(description, tf.distribute.get_strategy(), plan.num_replicas, devices, plan=plan)

    def build_model(self, build, placement):
        return build_on_stages(build, self.distribution.stages, placement.plan.variable_devices)

    def calls(self, step, placement, replica_rows):
        return LocalCalls(step, None, timed_loop_iterations(placement.on_gpus), replica_rows)

    def make_input(self, train, placement, global_batch):
        return lambda first_step, limit=None: iter(train.batches(global_batch, first_step, limit))
