"""SIGINT and SIGTERM become a request to stop at the next step boundary, after a checkpoint."""

import logging
import os
import signal
import sys
import threading

from gpupar.errors import GpuparError

log = logging.getLogger("gpupar")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(GpuparError):
    """Training stopped on a signal after saving; `exit_status` is the shell's 128 + signal."""

    def __init__(self, signum: int, checkpoint):
        self.signum = signum
        self.exit_status = 128 + signum
        where = f"saved {checkpoint}; resume with --resume" if checkpoint else "no model_dir, nothing saved"
        super().__init__(f"interrupted by {signal.Signals(signum).name} ({where})")


class StopRequests:
    """While active, the first SIGINT/SIGTERM sets `signum`; a second one exits at once."""

    def __init__(self):
        self.signum = None
        self._previous = {}

    def _handle(self, signum, _frame):
        if self.signum is not None:
            sys.stderr.write(f"gpupar: {signal.Signals(signum).name} again: exiting now, without saving\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum
        log.info("%s received: saving a checkpoint at the next step boundary (send it again to quit at once)",
                 signal.Signals(signum).name)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signals reach only the main thread
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False
