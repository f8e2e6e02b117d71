"""SIGINT and SIGTERM become a request to stop at the next step boundary, after a checkpoint."""

import os
import signal
import threading

from gpupar.errors import GpuparError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(GpuparError, SystemExit):
    """Training stopped on a signal after saving; `exit_status` is the shell's 128 + signal.

    It is a SystemExit too, with that status as its code: uncaught (a script's gpupar.fit under
    `gpupar launch`), it ends the process as the signal would have, with the training log's one
    line that says what was saved and no traceback.
    """

    def __init__(self, signum: int, checkpoint):
        self.signum = signum
        self.exit_status = self.code = 128 + signum
        where = f"saved {checkpoint}; resume with --resume" if checkpoint else "no model_dir, nothing saved"
        super().__init__(f"interrupted by {signal.Signals(signum).name} ({where})")


_ACTIVE = []  # the StopRequests whose handlers are in place in this process, outermost first
_MASK = []  # the forking thread's signal mask from before a fork, while the signals are held back for it


def _hold_signals_for_fork():
    """Blocks SIGINT and SIGTERM in the forking thread while gpupar handles them, until both sides are set.

    A signal that reached the child before its handlers were put back would be lost: Python
    discards the signals its handlers had not yet run for in a new child. Blocked, it waits.
    """
    if _ACTIVE:
        _MASK.append(signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS))


def _release_signals():
    if _MASK:
        signal.pthread_sigmask(signal.SIG_SETMASK, _MASK.pop())


def _previous_handlers_in_child():
    """In a forked child (a PyDataset's worker process), puts back the handlers from before gpupar's.

    A child that kept gpupar's handler would only note a SIGTERM and carry on, so the
    multiprocessing pool's terminate() (SIGTERM, then join) would wait for it forever.
    """
    while _ACTIVE:
        _ACTIVE.pop().restore()
    _release_signals()


os.register_at_fork(before=_hold_signals_for_fork, after_in_parent=_release_signals,
                    after_in_child=_previous_handlers_in_child)


class StopRequests:
    """While active, the first SIGINT/SIGTERM sets `signum`; a second one exits at once.

    The handler only records the signal (printing from it could collide with a write in
    progress); the training loop reports it. The second signal exits with the first's status.
    Processes forked meanwhile start with the handlers from before.
    """

    def __init__(self):
        self.signum = None
        self._previous = {}

    def _handle(self, signum, _frame):
        if self.signum is not None:
            os.write(2, f"gpupar: {signal.Signals(signum).name} again: exiting now, without saving\n".encode())
            os._exit(128 + self.signum)
        self.signum = signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals reach only the main thread
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            _ACTIVE.append(self)
        return self

    def reinstall(self):
        """Takes the signals back from a handler installed since __enter__.

        TensorFlow's distributed runtime (its coordination service's preemption notifier) puts
        its own SIGTERM handler in place when a multi-worker strategy starts.
        """
        if self._previous:
            for s in SIGNALS:
                signal.signal(s, self._handle)

    def restore(self):
        """Puts back the handlers that were in place before __enter__."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def __exit__(self, *exc):
        self.restore()
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        return False
