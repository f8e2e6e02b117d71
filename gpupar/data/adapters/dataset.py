"""An unbatched tf.data.Dataset, batched by the global batch; a resumed run skips the batches already trained."""

import math

import numpy as np
import tensorflow as tf

from gpupar.data import array_pipeline
from gpupar.data.adapters.adapter import DataAdapter, whole_steps
from gpupar.errors import GpuparError

INFINITE = -1  # the length of an endless dataset


class DatasetAdapter(DataAdapter):
    """A tf.data.Dataset of (x, y) or (x, y, sample_weight) examples, unbatched.

    Its length is known (examples), unknown, or infinite; an evaluation set must be finite, and
    one of unknown length is counted once before training.
    """

    num_examples = None

    def __init__(self, data, role: str):
        super().__init__(data, role)
        self.form = "a tf.data.Dataset"
        if isinstance(data, tf.data.Dataset) and batched(data):
            raise GpuparError(f"{role} is a batched tf.data.Dataset; pass it unbatched (gpupar batches it by the "
                              "global batch: dataset.unbatch()), or pass a dataset_fn(input_context) that returns "
                              "per-replica batches")

    @classmethod
    def takes(cls, data) -> bool:
        return isinstance(data, tf.data.Dataset)

    def prepare(self, input_options, seed: int):
        super().prepare(input_options, seed)
        count = counted(self.data, self.role)
        if count == INFINITE and self.role == "eval_data":
            raise GpuparError(f"{self.role} is endless; evaluation goes over the whole set once per epoch: give a "
                              "finite dataset (e.g. without .repeat())")
        self.num_examples = None if count == INFINITE else count
        self.description = self._describe(count)

    def _describe(self, count) -> str:
        return f"a tf.data.Dataset of {count if count not in (None, INFINITE) else 'endless'} examples"

    def sample(self, count: int = 4):
        return next(iter(self.data.batch(count).take(1).as_numpy_iterator()))

    def steps_per_epoch(self, global_batch: int, batches_per_step: int = 1):
        steps = None if self.num_examples is None else self.num_examples // global_batch
        return whole_steps(steps, self.description, global_batch)

    def batches(self, global_batch: int, first_step: int = 0, limit=None):
        dataset = self.data.batch(global_batch, drop_remainder=True).repeat().skip(first_step)
        dataset = dataset.prefetch(tf.data.AUTOTUNE).with_options(array_pipeline.options())
        return dataset if limit is None else dataset.take(limit)

    def evaluation(self, global_batch: int):
        dataset = self.data.batch(global_batch).repeat().prefetch(tf.data.AUTOTUNE)
        return dataset.with_options(array_pipeline.options()), math.ceil(self.num_examples / global_batch)


def batched(dataset) -> bool:
    """Whether a tf.data.Dataset is batched: a batch transformation in its chain after the last unbatch."""
    while dataset is not None:
        name = type(dataset).__name__
        if "Unbatch" in name:
            return False
        if "Batch" in name:
            return True
        dataset = getattr(dataset, "_input_dataset", None)
    return False


def counted(dataset, role: str):
    """The dataset's length: its elements, INFINITE, or None (unknown, for training); an evaluation set is counted.

    Raises:
      GpuparError: an empty dataset.
    """
    count = int(dataset.cardinality())
    if count == 0:
        raise GpuparError(f"{role} is empty")
    if count == tf.data.INFINITE_CARDINALITY:
        return INFINITE
    if count == tf.data.UNKNOWN_CARDINALITY:
        if role != "eval_data":
            return None
        count = int(dataset.reduce(np.int64(0), lambda n, _: n + 1))  # counted once, before training
    return count
