"""A tf.data.Dataset: batched ones as they are (as model.fit takes them), unbatched ones batched by the global batch."""

import math

import numpy as np
import tensorflow as tf

from gpupar.data import array_pipeline
from gpupar.data.adapters.adapter import DataAdapter, whole_steps
from gpupar.errors import GpuparError

INFINITE = -1  # the length of an endless dataset


class DatasetAdapter(DataAdapter):
    """A tf.data.Dataset of x, (x, y) or (x, y, sample_weight) elements.

    Batched, as Keras users pass it, each element is one step's global batch, split over the
    replicas (the last partial batch of a pass too); unbatched, gpupar batches it by the global
    batch. Its length (batches, or examples) is known, unknown, or infinite; an evaluation set
    must be finite, and one of unknown length is counted once before training. A resumed run
    skips the batches already trained.
    """

    num_examples = None  # examples (unbatched) or batches (batched) in one pass, where known

    def __init__(self, data, role: str, class_weight=None):
        super().__init__(data, role)
        self.form = "a tf.data.Dataset"
        self.own_batches = isinstance(data, tf.data.Dataset) and batched(data)
        self.class_weight = class_weight

    @classmethod
    def takes(cls, data) -> bool:
        return isinstance(data, tf.data.Dataset)

    def prepare(self, input_options, seed: int):
        super().prepare(input_options, seed)
        if self.class_weight is not None:
            self.data = self.data.map(weighted_by_class(self.class_weight))
            self.class_weight = None
        count = counted(self.data, self.role)
        if count == INFINITE and self.role != "x":
            raise GpuparError(f"{self.role} is endless; evaluation goes over the whole set once per epoch: give a "
                              "finite dataset (e.g. without .repeat())")
        self.num_examples = None if count == INFINITE else count
        self.description = self._describe(count)

    def _describe(self, count) -> str:
        unit = "batches" if self.own_batches else "examples"
        return f"a tf.data.Dataset of {count if count not in (None, INFINITE) else 'endless'} {unit}"

    def sample(self, count: int = 4):
        return next(iter((self.data if self.own_batches else self.data.batch(count)).take(1).as_numpy_iterator()))

    def steps_per_epoch(self, global_batch: int, batches_per_step: int = 1):
        if self.num_examples is None:
            return None
        return whole_steps(self.num_examples if self.own_batches else math.ceil(self.num_examples / global_batch),
                           self.description, global_batch)

    def counted_steps(self, global_batch: int):
        """As Keras' fit learns the length of such a dataset in its first epoch, one pass over it, counted here."""
        self.num_examples = counted(self.data, "every pass")
        self.description = self._describe(self.num_examples)
        return self.steps_per_epoch(global_batch)

    def batches(self, global_batch: int, first_step: int = 0, limit=None):
        dataset = self.data if self.own_batches else self.data.batch(global_batch)
        dataset = dataset.repeat().skip(first_step).prefetch(tf.data.AUTOTUNE).with_options(array_pipeline.options())
        return dataset if limit is None else dataset.take(limit)

    def one_pass(self, global_batch: int):
        dataset = self.data if self.own_batches else self.data.batch(global_batch)
        steps = self.num_examples if self.own_batches else math.ceil(self.num_examples / global_batch)
        return dataset.with_options(array_pipeline.options()), steps


def batched(dataset) -> bool:
    """Whether a tf.data.Dataset gives batches, read from its element spec: as Keras takes it, unless it cannot be.

    Keras' fit takes every dataset as batched, its batch size the leading dimension of its first
    element's spec (keras/src/trainers/data_adapters/tf_dataset_adapter.py). gpupar does too
    (zips and nested structures of batched datasets included), except where the spec says the
    elements are single examples: a scalar among them, or leading dimensions that differ (a batch
    gives every tensor the same one); such a dataset gpupar batches by the global batch.
    """
    shapes = [spec.shape for spec in tf.nest.flatten(dataset.element_spec) if hasattr(spec, "shape")]
    if any(shape.rank == 0 for shape in shapes):
        return False
    return len({shape[0] for shape in shapes if shape.rank is not None}) <= 1


def counted(dataset, role: str):
    """The dataset's length: its elements, INFINITE, or None (unknown, for training, where steps_per_epoch may make
    counting needless); any other is counted.

    Raises:
      GpuparError: an empty dataset.
    """
    count = int(dataset.cardinality())
    if count == 0:
        raise GpuparError(f"{role} is empty")
    if count == tf.data.INFINITE_CARDINALITY:
        return INFINITE
    if count == tf.data.UNKNOWN_CARDINALITY:
        if role == "x":
            return None
        count = int(dataset.reduce(np.int64(0), lambda n, _: n + 1))  # counted once, before training
    return count


def weighted_by_class(class_weight):
    """A map of (x, y[, sample_weight]) elements to (x, y, class_weight[class of y] [* sample_weight]), as Keras' fit.

    The class of a label is the label (shape (N,) or (N, 1)), or its argmax for one-hot labels; a
    class the dict does not name weighs 1.0, as in Keras.
    """
    classes = max(class_weight) + 1
    table = tf.constant([float(class_weight.get(c, 1.0)) for c in range(classes)], tf.float32)

    def weigh(*element):
        if len(element) < 2:
            raise GpuparError("class_weight weighs the examples by their labels' classes, and the data have no y")
        x, y = element[:2]
        if isinstance(y, (dict, tuple, list)):
            raise GpuparError("class_weight is only supported for models with a single output (as in Keras); give "
                              "sample weights per output instead")
        label = tf.argmax(y, axis=-1) if y.shape.rank > 1 and y.shape[-1] > 1 else tf.reshape(
            tf.cast(tf.round(tf.cast(y, tf.float32)), tf.int64), [-1] if y.shape.rank else [])
        weight = tf.where(label < classes, tf.gather(table, tf.minimum(label, classes - 1)), 1.0)
        return (x, y, weight if len(element) == 2 else weight * tf.cast(element[2], tf.float32))

    return weigh
