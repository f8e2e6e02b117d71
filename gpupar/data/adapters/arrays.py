"""In-memory arrays, `(x, y)` or `(x, y, sample_weight)`, through gpupar's seeded pipeline: exact mid-epoch resume."""

import numpy as np
import tensorflow as tf

from gpupar.data import array_pipeline
from gpupar.data.adapters.adapter import DataAdapter
from gpupar.errors import GpuparError


class ArrayAdapter(DataAdapter):
    """Arrays, each part an array or a dict or tuple of arrays, one row per example.

    Each pass is a fresh permutation from (seed, pass), so a run resumed mid-epoch trains on
    exactly the batches it would have seen. `transform` maps each batch after it is drawn;
    `host_transform(example, pass, position)` each example on the host (the MNIST preset's).
    """

    resume_note = None
    transform = None
    host_transform = None

    def __init__(self, data, role: str):
        super().__init__(data, role)
        self.arrays, self.num_examples = checked_arrays(data, role)
        self.description = f"arrays of {self.num_examples} examples"

    @classmethod
    def takes(cls, data) -> bool:
        return isinstance(data, (tuple, list))

    def sample(self, count: int = 4):
        if self.host_transform is not None:
            examples = [self.host_transform(tf.nest.map_structure(lambda a: a[i], self.arrays), tf.constant(0, tf.int64),
                                            tf.constant(i, tf.int64)) for i in range(count)]
            return tf.nest.map_structure(lambda *parts: np.stack([np.asarray(p) for p in parts]), *examples)
        batch = tf.nest.map_structure(lambda a: a[:count], self.arrays)
        batch = batch if self.transform is None else self.transform(*batch)
        return tf.nest.map_structure(np.asarray, batch)

    def labels(self):
        return self.arrays[1]

    def steps_per_epoch(self, global_batch: int, batches_per_step: int = 1) -> int:
        return array_pipeline.batches_per_epoch(self.num_examples, global_batch)

    def batches(self, global_batch: int, first_step: int = 0, limit=None):
        options = self.options
        dataset = array_pipeline.train_dataset(
            self.arrays, global_batch, self.seed, start_step=first_step, transform=self.transform,
            host_transform=self.host_transform, num_parallel_calls=options.num_parallel_calls if options else None,
            deterministic=options.deterministic if options else True, threads=options.data_threads if options else None)
        return dataset if limit is None else dataset.take(limit)

    def evaluation(self, global_batch: int):
        return (array_pipeline.eval_dataset(self.arrays, global_batch, self.transform),
                array_pipeline.test_steps(self.num_examples, global_batch))


def checked_arrays(data, what: str):
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
