"""A Python generator of batches, or a function that makes one per pass, as model.fit takes a generator."""

import inspect
import itertools

import tensorflow as tf

from gpupar.data import array_pipeline
from gpupar.data.adapters.python_batches import InputError, PythonBatches
from gpupar.errors import GpuparError

MAX_COUNTED = 1_000_000  # batches counted in a generator function's pass before it is taken for endless


class GeneratorAdapter(PythonBatches):
    """Batches (x,), (x, y) or (x, y, sample_weight) from a generator.

    A generator object is one stream, as model.fit reads it: its length is unknown until it ends,
    so steps_per_epoch must say how many batches make an epoch (validation_steps how many each
    evaluation reads, as validation_data); a resumed run reads the batches
    already trained again from the start and skips them. A generator *function* (no arguments) is
    called once per pass, so it can train many epochs; a pass's length is counted once before
    training; a resumed run calls it and skips the batches already
    trained in the epoch. Either is the same data on resume only if it yields the same batches in
    the same order on every run.
    """

    resume_note = ("a generator resumes by reading again and skipping the batches already trained: the same batches "
                   "only if it yields them in the same order on every run")

    def __init__(self, data, role: str, class_weight=None):
        super().__init__(data, role, class_weight)
        self.function = inspect.isgeneratorfunction(data)
        self.form = "a generator function" if self.function else "a generator"
        self.description = self.form

    @classmethod
    def takes(cls, data) -> bool:
        return inspect.isgenerator(data) or inspect.isgeneratorfunction(data)

    def prepare(self, input_options, seed: int):
        if not self.function and self.role != "x" and input_options.validation_steps is None:
            raise GpuparError(f"{self.role} is a generator, one stream of unknown length, and the evaluation after "
                              "every epoch reads a set: give validation_steps (each evaluation then reads that many "
                              "more of its batches, as model.fit does), or a generator function, a PyDataset or arrays")
        super().prepare(input_options, seed)
        if self.function:
            self.batches_per_pass = self._counted()
        self.description = self.form + (f" of {self.batches_per_pass} batches a pass" if self.batches_per_pass else "")

    def _counted(self) -> int:
        """Batches in one call of the generator function, counted once before training."""
        count = sum(1 for _ in itertools.islice(self._call(), MAX_COUNTED))
        if count == 0:
            raise GpuparError(f"{self.role} is a generator function that yields no batch")
        if count == MAX_COUNTED:
            raise GpuparError(f"{self.role} is a generator function that yields {MAX_COUNTED:,} batches or more "
                              "(endless?); give a generator (with steps_per_epoch) or a PyDataset")
        return count

    def _call(self):
        try:
            return self.data()
        except TypeError as e:
            raise GpuparError(f"{self.role}: the generator function cannot be called without arguments ({e})") from None

    def validation_batches(self, global_batch: int, max_steps=None):
        """(the evaluation batches, batches in one evaluation); a generator's as Keras' fit reads it.

        A generator function's evaluation is one pass (or its first max_steps batches) each time.
        A generator's, validation_steps batches each time, as Keras' generator adapter gives
        them: the first batches it read for the spec, again every time, then the next ones of the
        stream (keras/src/trainers/data_adapters/generator_data_adapter.py).
        """
        if self.function:
            return super().validation_batches(global_batch, max_steps)
        first = self.first[:max_steps]

        def each_evaluation():
            rest = self._read(self.data, len(self.first))
            while True:
                yield from first
                for number, batch in enumerate(itertools.islice(rest, max_steps - len(first)), start=len(first)):
                    yield self._checked(batch, number)

        dataset = tf.data.Dataset.from_generator(each_evaluation, output_signature=self.spec).prefetch(2)
        return dataset.with_options(array_pipeline.no_autotune()), max_steps

    def stream(self, first_step: int):
        if not self.function:  # the batches read for the spec, then the rest of the one stream
            yield from itertools.islice(self._read(itertools.chain(self.first, self.data), 0), first_step, None)
            return
        skip = first_step % self.batches_per_pass if self.batches_per_pass else first_step
        while True:
            yield from itertools.islice(self._read(self._call(), 0), skip, None)
            skip = 0

    def _read(self, batches, first_number):
        number = first_number
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except Exception as e:  # the user's generator: its error names the batch
                raise InputError(f"{self.role}: {self.form} raised {type(e).__name__} at batch {number}: "
                                 f"{str(e).splitlines()[0][:200] if str(e) else ''}", cause=e)
            yield batch
            number += 1
