"""A keras.utils.PyDataset: batches by index, made by its workers (threads or processes), resumed exactly."""

import collections
import concurrent.futures
import multiprocessing

import numpy as np

from gpupar.data.adapters.python_batches import InputError, PythonBatches
from gpupar.errors import GpuparError

_DATASET = None  # the PyDataset of a worker process (use_multiprocessing)


def _set_dataset(dataset):
    global _DATASET
    _DATASET = dataset


def _item(index):
    return _DATASET[index]


class PyDatasetAdapter(PythonBatches):
    """A keras.utils.PyDataset, as model.fit takes it: its __getitem__(i) is batch i, __len__ the batches of a pass.

    Its `workers` threads (processes with `use_multiprocessing`) make up to `max_queue_size`
    batches ahead, in order. With shuffle (model.fit's default) each pass reads the batches in a
    fresh order drawn from (seed, pass), so a run resumed mid-epoch reads exactly the batches an
    uninterrupted run would; on_epoch_end is called after each pass. An endless PyDataset (no
    length) needs steps_per_epoch.
    """

    resume_note = ("a PyDataset resumes exactly: its batches are read by index, in an order drawn from the seed and "
                   "the pass")

    def __init__(self, data, role: str, class_weight=None):
        super().__init__(data, role, class_weight)
        self.form = f"a PyDataset ({type(data).__name__})"
        self.description = self.form

    @classmethod
    def takes(cls, data) -> bool:
        import keras

        return isinstance(data, keras.utils.PyDataset)

    def prepare(self, input_options, seed: int):
        self.batches_per_pass = self.data.num_batches
        if self.batches_per_pass == 0:
            raise GpuparError(f"{self.role} is an empty PyDataset ({type(self.data).__name__} has length 0)")
        super().prepare(input_options, seed)
        workers = self.data.workers
        self.description = (f"{self.form} of {self.batches_per_pass or 'endless'} batches, "
                            f"{workers} {'process' if self.data.use_multiprocessing else 'thread'}(s) making up to "
                            f"{self.data.max_queue_size} ahead")

    def _order(self, number):
        """The batch indices of pass `number`: shuffled from (seed, pass), or in order."""
        count = self.batches_per_pass
        shuffle = self.options.shuffle if self.options is not None else True
        if not shuffle:
            return np.arange(count)
        return np.random.default_rng([self.seed, number]).permutation(count)

    def _indices(self, first_step: int):
        """The index of every batch from the global step first_step, endless; on_epoch_end between passes."""
        if self.batches_per_pass is None:
            step = first_step
            while True:
                yield step
                step += 1
        number, skip = divmod(first_step, self.batches_per_pass)
        while True:
            for index in self._order(number)[skip:]:
                yield int(index)
            self.data.on_epoch_end()
            number, skip = number + 1, 0

    def stream(self, first_step: int):
        workers, ahead = max(1, self.data.workers), max(1, self.data.max_queue_size)
        if workers == 1 and not self.data.use_multiprocessing:
            for index in self._indices(first_step):
                yield self._get(lambda: self.data[index], index)
            return
        if self.data.use_multiprocessing:
            pool = multiprocessing.get_context("fork").Pool(workers, initializer=_set_dataset, initargs=(self.data,))
            submit = lambda index: pool.apply_async(_item, (index,)).get  # noqa: E731
        else:
            pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="gpupar-pydataset")
            submit = lambda index: pool.submit(self.data.__getitem__, index).result  # noqa: E731
        pending = collections.deque()
        try:
            for index in self._indices(first_step):
                pending.append((index, submit(index)))
                if len(pending) >= ahead:
                    done_index, result = pending.popleft()
                    yield self._get(result, done_index)
        finally:
            (pool.terminate if self.data.use_multiprocessing else lambda: pool.shutdown(wait=False,
                                                                                      cancel_futures=True))()

    def _get(self, make, index):
        try:
            return make()
        except Exception as e:  # the user's __getitem__: its error names the batch
            raise InputError(f"{self.role}: {type(self.data).__name__}[{index}] raised {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''}", cause=e)
