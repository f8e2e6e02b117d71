"""What every input form offers the modes: its checks, its length, its batches and how they are distributed.

One adapter class per form (arrays, a tf.data.Dataset, a dataset_fn, a TFDS name, the MNIST
presets' arrays), as Keras keeps one per form behind `get_data_adapter`. The engine and the
modes ask an adapter for batches and never which form it is.
"""

from typing import List, Optional, Tuple

import tensorflow as tf

from gpupar.data import array_pipeline
from gpupar.errors import GpuparError


class DataAdapter:
    """One data set of a run, in one form.

    An adapter is made from what the user gave with the checks that need no TensorFlow (a
    parameter-server run refuses a form before it joins its cluster); `prepare` does the rest
    once the strategy exists, since TensorFlow must not run before a multi-worker strategy does.

    Attributes:
      form: What the data are, as errors name them ("a tuple", "a dataset_fn", ...).
      per_worker: Whether each parameter-server worker can make its own pipeline from the data.
      per_replica_batches: Whether the form gives per-replica batches of its own (a dataset_fn).
      own_batches: Whether the form's elements are batches of its own (a batched dataset, a
        PyDataset, a generator, a dataset_fn) rather than examples that gpupar batches.
      resume_note: What resuming mid-epoch does with this form; None where it replays exactly.
      description: How the log names the data (set by prepare).
    """

    per_worker = False
    per_replica_batches = False
    own_batches = False
    resume_note: Optional[str] = ("the data are not gpupar's arrays, so resuming mid-epoch skips the batches already "
                                  "trained: the same batches only if the data come in the same order on every run "
                                  "(e.g. a shuffle with a fixed seed)")

    def __init__(self, data, role: str):
        self.data, self.role = data, role
        self.form = f"a {type(data).__name__}"
        self.description = self.form
        self.options, self.seed = None, 0

    @classmethod
    def takes(cls, data) -> bool:
        """Whether `data` is of this form."""
        raise NotImplementedError

    def prepare(self, input_options, seed: int):
        """The checks and counts that need TensorFlow; `input_options` and `seed` shape the pipelines."""
        self.options, self.seed = input_options, seed

    def batch_size(self, input_options, replicas: int) -> int:
        """Examples in one step over all replicas: batch_size, per_replica_batch_size times the replicas, or 32 (Keras'
        default); a form with batches of its own gives its first batch's size and refuses both options.

        Raises:
          GpuparError: a batch option for data that bring their own batches.
        """
        given = input_options.batch_size or (input_options.per_replica_batch_size or 0) * replicas or None
        if not self.own_batches:
            return given or 32
        if given:
            option = "batch_size" if input_options.batch_size else "per_replica_batch_size"
            raise GpuparError(f"{option} is set, but {self.role} is {self.form} whose batches are its own: each of its "
                              f"batches is one step; drop {option}")
        rows = len(tf.nest.flatten(self.sample())[0])
        return rows * (replicas if self.per_replica_batches else 1)

    def sample(self, count: int = 4):
        """The first `count` examples as a batch of NumPy arrays (as the model sees them), for the checks before training."""
        raise NotImplementedError

    def labels(self):
        """Every label where they are in memory (for the range check of a sparse loss), else None."""
        return None

    def steps_per_epoch(self, global_batch: int, batches_per_step: int = 1) -> Optional[int]:
        """Whole steps in one pass (None for an endless or unknown-length data set).

        batches_per_step: per-replica batches one input pipeline gives a step (a dataset_fn's).
        """
        raise NotImplementedError

    def counted_steps(self, global_batch: int) -> Optional[int]:
        """Whole steps in one pass of data of unknown length, counted by going over it once (None: it cannot be)."""
        return None

    def batches(self, global_batch: int, first_step: int = 0, limit: Optional[int] = None):
        """Endless global batches from global step first_step (at most `limit` of them)."""
        raise NotImplementedError

    def distribute(self, strategy, global_batch: int, first_step: int, limit: Optional[int], per_pipeline: int):
        """The batches from first_step, distributed over the strategy's replicas (per_pipeline replicas per pipeline)."""
        return strategy.experimental_distribute_dataset(self.batches(global_batch, first_step, limit))

    def worker_batches(self, context, global_batch: int, first_step: int, limit: Optional[int], num_workers: int):
        """One parameter-server worker's batches, from the global step first_step (per_worker forms only)."""
        raise GpuparError(f"{self.role} is {self.form}; each parameter-server worker needs a pipeline of its own")

    def one_pass(self, global_batch: int) -> Tuple[object, int]:
        """(the whole set once, in global batches, the last partial one included; batches in the pass)."""
        raise NotImplementedError

    def validation_batches(self, global_batch: int, max_steps: Optional[int] = None):
        """(the evaluation batches, repeated for one iterator per run; batches in one evaluation).

        max_steps (validation_steps) evaluates the first max_steps batches each time, as Keras' fit.
        """
        dataset, steps = self.one_pass(global_batch)
        if max_steps is not None and max_steps < steps:
            dataset, steps = dataset.take(max_steps), max_steps
        return dataset.repeat().prefetch(2).with_options(array_pipeline.no_autotune()), steps

    def distribute_validation(self, strategy, global_batch: int, per_pipeline: int, max_steps: Optional[int] = None):
        """(the evaluation batches distributed over the strategy's replicas, batches in one evaluation)."""
        dataset, steps = self.validation_batches(global_batch, max_steps)
        return strategy.experimental_distribute_dataset(dataset), steps

    def input_bound_hints(self) -> List[str]:
        """What in this form's pipeline may starve the step, each with its fix (the input-bound warning's)."""
        return []


def whole_steps(steps: Optional[int], description: str, global_batch: int) -> Optional[int]:
    """steps, refusing a data set that holds less than one step."""
    if steps is not None and steps < 1:
        raise GpuparError(f"the training data ({description}) hold less than one step of {global_batch} examples; "
                          "lower batch_size")
    return steps
