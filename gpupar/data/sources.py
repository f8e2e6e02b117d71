"""The data a run trains and evaluates on, in the forms `gpupar.fit` takes, each checked before any work.

- In-memory arrays: `(x, y)` or `(x, y, sample_weight)`, each part an array or a dict or tuple
  of arrays: gpupar's seeded pipeline (a fresh permutation per pass from (seed, pass)), whose
  mid-epoch resume is exact.
- An unbatched `tf.data.Dataset` of the same structure, batched here by the global batch; a
  resumed run skips the batches already trained.
- A `dataset_fn(input_context)` that returns per-replica batches, for
  `strategy.distribute_datasets_from_function` (the form multi-worker input pipelines need).
- A TFDS name, "tfds:NAME" or "tfds:NAME:SPLIT": `tfds.load(NAME, split=SPLIT,
  as_supervised=True)`, the split "train" for training and "test" for evaluation by default.
"""

import dataclasses
import math
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from gpupar.data import pipeline, tfds
from gpupar.errors import GpuparError

ARRAYS, DATASET, DATASET_FN = "arrays", "dataset", "dataset_fn"
TFDS_PREFIX = "tfds:"


@dataclasses.dataclass
class Source:
    """One data set of a run, in one of the forms above.

    Attributes:
      kind: ARRAYS, DATASET or DATASET_FN.
      description: How the log names it, e.g. "arrays of 60000 examples".
      data: The arrays (a structure), the unbatched tf.data.Dataset, or the dataset_fn.
      num_examples: Examples in one pass, where known (ARRAYS, DATASET).
      batches: Per-replica batches in one pass of one input pipeline, where known (DATASET_FN).
      transform: For arrays: applied to each batch after it is drawn (the MNIST preset normalises).
      host_transform: For arrays: applied to each example on the host (the preset's host augmentation).
    """

    kind: str
    description: str
    data: Any
    num_examples: Optional[int] = None
    batches: Optional[int] = None
    transform: Optional[Callable] = None
    host_transform: Optional[Callable] = None

    @property
    def resume_note(self) -> Optional[str]:
        """What a mid-epoch resume does with this form, where it is not an exact replay."""
        if self.kind == ARRAYS:
            return None
        return ("the data are not gpupar's arrays, so resuming mid-epoch skips the batches already trained: the same "
                "batches only if the data come in the same order on every run (e.g. a shuffle with a fixed seed)")

    def steps_per_epoch(self, global_batch: int, batches_per_step: int = 1) -> Optional[int]:
        """Whole steps in one pass (None for an endless or unknown-length dataset)."""
        if self.kind == ARRAYS:
            return pipeline.batches_per_epoch(self.num_examples, global_batch)
        if self.kind == DATASET_FN:
            steps = None if self.batches is None else self.batches // batches_per_step
        else:
            steps = None if self.num_examples is None else self.num_examples // global_batch
        if steps is None:
            return None
        if steps < 1:
            raise GpuparError(f"the training data ({self.description}) hold less than one step of {global_batch} "
                              "examples; lower batch_size")
        return steps

    def training(self, global_batch: int, seed: int, first_step: int, limit=None, config=None) -> tf.data.Dataset:
        """Endless global batches from global step first_step (ARRAYS and DATASET)."""
        if self.kind == ARRAYS:
            dataset = pipeline.train_dataset(
                self.data, global_batch, seed, start_step=first_step, transform=self.transform,
                host_transform=self.host_transform, num_parallel_calls=config.num_parallel_calls if config else None,
                deterministic=config.deterministic if config else True, threads=config.data_threads if config else None)
        else:
            dataset = self.data.batch(global_batch, drop_remainder=True).repeat().skip(first_step)
            dataset = dataset.prefetch(tf.data.AUTOTUNE).with_options(pipeline.options())
        return dataset if limit is None else dataset.take(limit)

    def evaluation(self, global_batch: int):
        """(the whole set in global batches, the last partial one included, repeated; batches in one pass).

        A dataset_fn's batches are its own, from one input pipeline of one replica.
        """
        if self.kind == ARRAYS:
            return (pipeline.eval_dataset(self.data, global_batch, self.transform),
                    pipeline.test_steps(self.num_examples, global_batch))
        if self.kind == DATASET_FN:
            return self.data(_input_context(1)).repeat().prefetch(tf.data.AUTOTUNE), self.batches
        dataset = self.data.batch(global_batch).repeat().prefetch(tf.data.AUTOTUNE).with_options(pipeline.options())
        return dataset, math.ceil(self.num_examples / global_batch)

    def sample(self, count: int = 4):
        """The first `count` examples as a batch of NumPy arrays (as the model sees them), for the checks before training."""
        if self.kind == ARRAYS and self.host_transform is not None:
            examples = [self.host_transform(tf.nest.map_structure(lambda a: a[i], self.data), tf.constant(0, tf.int64),
                                            tf.constant(i, tf.int64)) for i in range(count)]
            return tf.nest.map_structure(lambda *parts: np.stack([np.asarray(p) for p in parts]), *examples)
        if self.kind == ARRAYS:
            batch = tf.nest.map_structure(lambda a: a[:count], self.data)
            batch = batch if self.transform is None else self.transform(*batch)
            return tf.nest.map_structure(np.asarray, batch)
        dataset = self.data(_input_context(1)) if self.kind == DATASET_FN else self.data.batch(count)
        return next(iter(dataset.take(1).as_numpy_iterator()))


def _input_context(num_replicas):
    return tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=num_replicas)


def _batched(dataset) -> bool:
    """Whether a tf.data.Dataset is batched: a batch transformation in its chain after the last unbatch."""
    while dataset is not None:
        name = type(dataset).__name__
        if "Unbatch" in name:
            return False
        if "Batch" in name:
            return True
        dataset = getattr(dataset, "_input_dataset", None)
    return False


def _cardinality(dataset, what) -> Optional[int]:
    count = int(dataset.cardinality())
    if count == tf.data.INFINITE_CARDINALITY:
        return -1
    if count == tf.data.UNKNOWN_CARDINALITY:
        return None
    if count == 0:
        raise GpuparError(f"{what} is empty")
    return count


def _arrays(data, what):
    """Checks an (x, y[, sample_weight]) tuple of arrays; returns (the structure as NumPy, examples)."""
    if not 2 <= len(data) <= 3:
        raise GpuparError(f"{what} is a tuple of {len(data)}; give (x, y) or (x, y, sample_weight)")
    data = tf.nest.map_structure(np.asarray, tuple(data))
    lengths = {}
    for part, name in zip(data, ("x", "y", "sample_weight")):
        for leaf in tf.nest.flatten(part):
            if leaf.ndim == 0:
                raise GpuparError(f"{what}: {name} holds a scalar; give one row per example")
            lengths.setdefault(name, set()).add(len(leaf))
    sizes = {n for s in lengths.values() for n in s}
    if len(sizes) != 1:
        shown = ", ".join(f"{name} {'/'.join(map(str, sorted(s)))}" for name, s in lengths.items())
        raise GpuparError(f"{what}: the arrays have different numbers of examples ({shown}); give every part one row "
                          "per example")
    return data, sizes.pop()


def _tfds(name: str, role: str):
    """(the unbatched TFDS dataset a "tfds:NAME[:SPLIT]" name gives, how the log names it)."""
    parts = name[len(TFDS_PREFIX):].split(":", 1)
    split = parts[1] if len(parts) == 2 else ("train" if role == "train_data" else "test")
    return tfds.load(parts[0], split), f"TFDS {parts[0]}, split {split}"


def resolve(data, role: str = "train_data") -> Source:
    """The Source for `data` given as train_data or eval_data, checked.

    Raises:
      GpuparError: a form gpupar does not take, arrays of different lengths, a batched dataset
        (or an unbatched one from a dataset_fn), an endless or empty evaluation set, a bad TFDS name.
    """
    what = role
    if isinstance(data, str):
        if not data.startswith(TFDS_PREFIX):
            raise GpuparError(f"{what}={data!r}: a name of a data set must look like 'tfds:mnist' or 'tfds:cifar10:train'")
        data, description = _tfds(data, role)
    else:
        description = None
    if isinstance(data, tf.data.Dataset):
        if _batched(data):
            raise GpuparError(f"{what} is a batched tf.data.Dataset; pass it unbatched (gpupar batches it by the "
                              "global batch: dataset.unbatch()), or pass a dataset_fn(input_context) that returns "
                              "per-replica batches")
        count = _cardinality(data, what)
        if count == -1 and role == "eval_data":
            raise GpuparError(f"{what} is endless; evaluation goes over the whole set once per epoch: give a finite "
                              "dataset (e.g. without .repeat())")
        if count is None and role == "eval_data":
            count = int(data.reduce(np.int64(0), lambda n, _: n + 1))  # counted once, before training
        return Source(DATASET, description or f"a tf.data.Dataset of {count if count and count > 0 else 'endless'} "
                      "examples", data, None if count in (None, -1) else count)
    if callable(data) and not isinstance(data, (tuple, list)):
        try:
            dataset = data(_input_context(1))
        except Exception as e:
            raise GpuparError(f"{what}: the dataset_fn failed when called with an InputContext "
                              f"({type(e).__name__}: {e})") from None
        if not isinstance(dataset, tf.data.Dataset) or not _batched(dataset):
            raise GpuparError(f"{what} is a dataset_fn whose dataset is not batched; it must return per-replica "
                              "batches: dataset.batch(input_context.get_per_replica_batch_size(global_batch))")
        count = _cardinality(dataset, what)
        if count == -1 and role == "eval_data":
            raise GpuparError(f"{what} is a dataset_fn of an endless dataset; evaluation needs a finite one")
        if count is None and role == "eval_data":
            count = int(dataset.reduce(np.int64(0), lambda n, _: n + 1))  # batches counted once, before training
        return Source(DATASET_FN, "a dataset_fn", data, batches=None if count in (None, -1) else count)
    if isinstance(data, (tuple, list)):
        arrays, count = _arrays(data, what)
        return Source(ARRAYS, f"arrays of {count} examples", arrays, count)
    raise GpuparError(f"{what} is a {type(data).__name__}; give (x, y) arrays, an unbatched tf.data.Dataset, a "
                      "dataset_fn(input_context), or a TFDS name such as 'tfds:mnist'")
