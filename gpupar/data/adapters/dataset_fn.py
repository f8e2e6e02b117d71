"""A dataset_fn(input_context) that returns per-replica batches: each input pipeline makes its own."""

import tensorflow as tf

from gpupar.data import array_pipeline
from gpupar.data.adapters.adapter import DataAdapter, whole_steps
from gpupar.data.adapters.dataset import INFINITE, batched, counted
from gpupar.errors import GpuparError


def input_context(num_replicas: int = 1):
    """The InputContext of one pipeline of `num_replicas` replicas."""
    return tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=num_replicas)


class DatasetFnAdapter(DataAdapter):
    """A function of a tf.distribute.InputContext returning a dataset of per-replica batches.

    The form multi-worker pipelines need: `strategy.distribute_datasets_from_function` calls it
    once per input pipeline, and each parameter-server worker calls it for its own pipeline. A
    resumed run skips the batches each pipeline already gave.
    """

    per_worker = True
    per_replica_batches = True
    own_batches = True
    batches_per_pass = None  # per-replica batches in one pass of one pipeline, where known

    def __init__(self, data, role: str):
        super().__init__(data, role)
        self.form = self.description = "a dataset_fn"

    @classmethod
    def takes(cls, data) -> bool:
        return callable(data) and not isinstance(data, (tuple, list, tf.data.Dataset))

    def prepare(self, input_options, seed: int):
        super().prepare(input_options, seed)
        count = counted(self._called(input_context(1)), self.role)
        if count == INFINITE and self.role != "x":
            raise GpuparError(f"{self.role} is a dataset_fn of an endless dataset; evaluation needs a finite one")
        self.batches_per_pass = None if count == INFINITE else count

    def _called(self, context):
        try:
            dataset = self.data(context)
        except Exception as e:
            raise GpuparError(f"{self.role}: the dataset_fn failed when called with an InputContext "
                              f"({type(e).__name__}: {e})") from None
        if not isinstance(dataset, tf.data.Dataset) or not batched(dataset):
            raise GpuparError(f"{self.role} is a dataset_fn whose dataset is not batched; it must return per-replica "
                              "batches: dataset.batch(input_context.get_per_replica_batch_size(global_batch))")
        return dataset

    def sample(self, count: int = 4):
        return next(iter(self.data(input_context(1)).take(1).as_numpy_iterator()))

    def steps_per_epoch(self, global_batch: int, batches_per_step: int = 1):
        steps = None if self.batches_per_pass is None else self.batches_per_pass // batches_per_step
        return whole_steps(steps, self.description, global_batch)

    def distribute(self, strategy, global_batch: int, first_step: int, limit, per_pipeline: int):
        def replica_batches(context):  # a pipeline gives per_pipeline batches a step
            dataset = self.data(context).repeat().skip(first_step * per_pipeline).with_options(array_pipeline.no_autotune())
            return dataset if limit is None else dataset.take(limit * per_pipeline)

        return strategy.distribute_datasets_from_function(replica_batches)

    def worker_batches(self, context, global_batch: int, first_step: int, limit, num_workers: int):
        dataset = self.data(context).repeat().skip(first_step // num_workers).with_options(array_pipeline.no_autotune())  # its own
        return dataset if limit is None else dataset.take(limit)

    def one_pass(self, global_batch: int):
        """The batches are the dataset_fn's own, from one input pipeline of one replica."""
        return self.data(input_context(1)), self.batches_per_pass

    def distribute_validation(self, strategy, global_batch: int, per_pipeline: int, max_steps=None):
        if max_steps is not None and max_steps * per_pipeline < self.batches_per_pass:
            steps = max_steps  # each pipeline gives the first max_steps batches of each of its replicas
            dataset = strategy.distribute_datasets_from_function(
                lambda context: self.data(context).take(max_steps * per_pipeline).repeat().with_options(array_pipeline.no_autotune()))
            return dataset, steps
        if self.batches_per_pass % per_pipeline:
            raise GpuparError(f"validation_data's dataset_fn gives {self.batches_per_pass} batches per input pipeline, not a "
                              f"multiple of its {per_pipeline} replicas, so a last step would take batches of the "
                              "next pass; drop or pad the last batches, or give the evaluation set as arrays or a "
                              "dataset (gpupar splits a last partial batch itself)")
        dataset = strategy.distribute_datasets_from_function(
            lambda context: self.data(context).repeat().with_options(array_pipeline.no_autotune()))
        return dataset, self.batches_per_pass // per_pipeline
