"""Batches made by Python code (a keras.utils.PyDataset, a generator), fed to the strategy through tf.data.

A form made in Python gives each batch as (x,), (x, y) or (x, y, sample_weight) of arrays, or a
dict of inputs. The first batches set the tensor spec (a dimension that differs between them is
left open); every later batch is checked against it in Python, so a batch of another structure
or rank is an error that names the batch. Errors raised by the user's code while training (a
PyDataset's __getitem__, a generator) surface through tf.data; `input_errors` turns them into one
GpuparError line naming the data and the batch, raised from the user's own error (its traceback,
a worker process's included, is printed above it).
"""

import contextlib
import re

import numpy as np
import tensorflow as tf

from gpupar import keras_compat
from gpupar.data import array_pipeline
from gpupar.data.adapters.adapter import DataAdapter
from gpupar.data.adapters.arrays import class_weights
from gpupar.errors import GpuparError

SPEC_BATCHES = 2  # batches read before training to set the tensor spec
_MARK = "gpupar input error: "
_raised = {}  # the message of the last InputError raised from a user's error -> that error


class InputError(GpuparError):
    """A batch that the user's Python code made wrongly, or failed to make, while training.

    `cause`: the error the user's code raised, which it is raised from. tf.data passes on only the
    message, so the cause is also kept for input_errors to raise its GpuparError from.
    """

    def __init__(self, message, cause=None):
        super().__init__(_MARK + message)
        self.__cause__ = cause
        _raised.clear()
        if cause is not None:
            _raised[message] = cause


@contextlib.contextmanager
def input_errors():
    """Turns the error that a Python input raised inside tf.data into one GpuparError line, from the user's error."""
    try:
        yield
    except tf.errors.OpError as e:
        found = re.search(re.escape(_MARK) + r"(.*)", str(e))
        if found is None:
            raise
        message = found.group(1).strip()
        raise GpuparError(message) from _raised.pop(message, None)


def standardized(batch, what: str, class_weight=None):
    """A batch as a tuple (x,), (x, y) or (x, y, sample_weight) of NumPy arrays (dicts kept), as Keras' fit takes it."""
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple):
        batch = (batch,)
    if not 1 <= len(batch) <= 3:
        raise InputError(f"{what} is a tuple of {len(batch)}; give (x,), (x, y) or (x, y, sample_weight)")
    batch = tf.nest.map_structure(lambda a: a if isinstance(a, tf.RaggedTensor) else np.asarray(a), batch)
    if class_weight is not None:
        if len(batch) == 3:
            raise InputError("class_weight and sample weights in the batches both weigh the examples; give one")
        batch = batch + (class_weights(batch[1] if len(batch) > 1 else None, class_weight),)
    return batch


class PythonBatches(DataAdapter):
    """The base of forms whose batches Python code makes: the spec, the checks, tf.data's generator.

    A subclass says how to make batch number i of the stream from a global step (`stream`) and,
    where it knows, how many batches a pass holds (`batches_per_pass`).
    """

    own_batches = True
    batches_per_pass = None

    def __init__(self, data, role: str, class_weight=None):
        super().__init__(data, role)
        self.class_weight, self.spec, self.first = class_weight, None, []

    def stream(self, first_step: int):
        """The batches from the global step first_step on, endless (each pass's end starts the next)."""
        raise NotImplementedError

    def _checked(self, batch, number: int):
        what = f"{self.role} ({self.form}): batch {number}"
        batch = standardized(batch, what, self.class_weight)
        if self.spec is None:
            return batch
        try:
            tf.nest.assert_same_structure(batch, self.spec)
        except (ValueError, TypeError):
            raise InputError(f"{what} has another structure than the first batches "
                             f"({_shapes(batch)} against {_shapes(self.spec)})") from None
        for leaf, spec in zip(tf.nest.flatten(batch), tf.nest.flatten(self.spec)):
            if not spec.shape.is_compatible_with(leaf.shape):
                raise InputError(f"{what} has shape {tuple(leaf.shape)} where the first batches had "
                                 f"{tuple(spec.shape.as_list())}; give batches of consistent shapes")
        return batch

    def prepare(self, input_options, seed: int):
        super().prepare(input_options, seed)
        stream = self.stream(0)
        try:
            self.first = [self._checked(next(stream), i) for i in range(self._spec_batches())]
        except StopIteration:
            raise GpuparError(f"{self.role} ({self.form}) gave fewer batches than it says it has") from None
        finally:
            stream.close()  # its workers stop
        try:
            self.spec = keras_compat.tensor_spec_of(self.first)
        except (ValueError, TypeError) as e:
            raise GpuparError(f"{self.role} ({self.form}): its first batches do not agree in structure or rank "
                              f"({str(e).splitlines()[0][:160]}); give batches of consistent shapes") from None

    def _spec_batches(self) -> int:
        return min(SPEC_BATCHES, self.batches_per_pass or SPEC_BATCHES)

    def sample(self, count: int = 4):
        return self.first[0] if self.first else self._checked(next(self.stream(0)), 0)

    def steps_per_epoch(self, global_batch: int, batches_per_step: int = 1):
        return self.batches_per_pass

    def batches(self, global_batch: int, first_step: int = 0, limit=None):
        def numbered():
            for number, batch in enumerate(self.stream(first_step), start=first_step):
                yield self._checked(batch, number)

        dataset = tf.data.Dataset.from_generator(numbered, output_signature=self.spec).prefetch(2)
        dataset = dataset.with_options(array_pipeline.no_autotune())
        return dataset if limit is None else dataset.take(limit)

    def one_pass(self, global_batch: int):
        return self.batches(global_batch, limit=self.batches_per_pass), self.batches_per_pass


def _shapes(structure) -> str:
    return str(tf.nest.map_structure(lambda a: tuple(a.shape.as_list() if hasattr(a.shape, "as_list") else a.shape),
                                     structure))
