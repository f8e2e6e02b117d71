"""A keras.utils.PyDataset: batches by index, made by its workers (threads or processes), resumed exactly."""

import collections
import concurrent.futures
import multiprocessing

import numpy as np

from gpupar.data.adapters.python_batches import InputError, PythonBatches
from gpupar.errors import GpuparError

_DATASET = None  # the PyDataset of a worker process (use_multiprocessing)
STOP_SECONDS = 10  # how long a stopping stream waits for the batches its worker processes are making


def _set_dataset(dataset):
    global _DATASET
    _DATASET = dataset


def _item(index):
    return _DATASET[index]


def _stop_processes(pool, futures):
    """Stops a ProcessPoolExecutor's workers, never killing one while it sends a batch back.

    The batches not yet handed over are cancelled and those handed over (at most workers + 1) are
    waited for, so that each worker ends idle and exits on its own. Not multiprocessing.Pool's
    terminate(): it SIGTERMs workers that may be sending a result, and one killed holding the lock
    of the queue they share, or half-way through a result, left terminate() waiting for ever (rarely
    with small batches; within a few fits with batches of images, as tests/scripts/raising_pydataset.py
    makes). A batch still unmade after STOP_SECONDS (a __getitem__ that hangs) has every worker
    killed, but only while this process holds that lock, so that none is sending: the executor,
    which takes a killed worker for a broken pool, then shuts down.
    """
    for future in futures:
        future.cancel()
    _, unmade = concurrent.futures.wait(futures, timeout=STOP_SECONDS)
    if unmade:
        # Private to the executor of Python 3.10-3.13 (checked); 3.14's kill_workers() kills without the lock.
        sending = pool._result_queue._wlock
        held = sending.acquire(timeout=STOP_SECONDS)  # not held: the pool broke and its workers are ended
        for process in list(pool._processes.values()):
            process.kill()
        if held:
            sending.release()
    pool.shutdown(wait=True, cancel_futures=True)


class PyDatasetAdapter(PythonBatches):
    """A keras.utils.PyDataset, as model.fit takes it: its __getitem__(i) is batch i, __len__ the batches of a pass.

    Its `workers` threads (processes with `use_multiprocessing`) make up to `max_queue_size`
    batches ahead, in order; when the stream stops (a fit's end, an error) the batches not begun are
    dropped, and worker processes finish those they are making, then exit. With shuffle
    (model.fit's default) each pass reads the batches in a fresh order drawn from (seed, pass), so
    a run resumed mid-epoch reads exactly the batches an uninterrupted run would; on_epoch_end is
    called after each pass. An endless PyDataset (no length) needs steps_per_epoch.
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
            pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                                          initializer=_set_dataset, initargs=(self.data,))
            make = _item
        else:
            pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="gpupar-pydataset")
            make = self.data.__getitem__
        pending = collections.deque()
        try:
            for index in self._indices(first_step):
                pending.append((index, pool.submit(make, index)))
                if len(pending) >= ahead:
                    done_index, future = pending.popleft()
                    yield self._get(future.result, done_index)
        finally:
            if self.data.use_multiprocessing:
                _stop_processes(pool, [future for _, future in pending])
            else:  # a thread cannot be stopped: those busy finish their batch, unread
                pool.shutdown(wait=False, cancel_futures=True)

    def _get(self, make, index):
        try:
            return make()
        except Exception as e:  # the user's __getitem__: its error names the batch
            raise InputError(f"{self.role}: {type(self.data).__name__}[{index}] raised {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''}", cause=e)
