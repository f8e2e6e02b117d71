"""SIGINT and SIGTERM become a request to stop at the next step boundary, after a checkpoint."""

import os
import signal
import threading

from gpupar.errors import GpuparError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(GpuparError):
    """Training stopped on a signal after saving; `exit_status` is the shell's 128 + signal."""

    def __init__(self, signum: int, checkpoint):
        self.signum = signum
        self.exit_status = 128 + signum
        where = f"saved {checkpoint}; resume with --resume" if checkpoint else "no model_dir, nothing saved"
        super().__init__(f"interrupted by {signal.Signals(signum).name} ({where})")


class StopRequests:
    """While active, the first SIGINT/SIGTERM sets `signum`; a second one exits at once.

    The handler only records the signal (printing from it could collide with a write in
    progress); the training loop reports it. The second signal exits with the first's status.
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
        return self

    def reinstall(self):
        """Takes the signals back from a handler installed since __enter__.

        TensorFlow's distributed runtime (its coordination service's preemption notifier) puts
        its own SIGTERM handler in place when a multi-worker strategy starts.
        """
        if self._previous:
            for s in SIGNALS:
                signal.signal(s, self._handle)

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False
