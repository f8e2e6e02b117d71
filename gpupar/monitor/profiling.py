"""A TensorBoard profile of a chosen range of training steps (tf.profiler.experimental)."""

import logging

import tensorflow as tf

log = logging.getLogger("gpupar")


class ProfileWindow:
    """Starts the profiler before step `first` of the run and stops it after step `last` (from 1).

    The loop asks `limit` how many steps its next call may run, so that the window starts and
    ends on call boundaries.
    """

    def __init__(self, steps, log_dir):
        self.first, self.last = steps if steps else (None, None)
        self.log_dir, self.running = log_dir, False

    def limit(self, done: int, num: int) -> int:
        """Caps a call of `num` steps after `done` steps of the run at the window's edges."""
        for edge in (self.first - 1, self.last) if self.first else ():
            if done < edge:
                num = min(num, edge - done)
        return num

    def before(self, done: int):
        """Starts the capture when the next call begins the window (`done` steps run so far)."""
        if self.first and done == self.first - 1 and not self.running:
            tf.profiler.experimental.start(self.log_dir)
            self.running = True

    def after(self, done: int):
        """Stops the capture once the window's last step has run."""
        if self.running and done >= self.last:
            self.stop()
            log.info("profiled steps %d..%d of this run into %s (TensorBoard: Profile tab)",
                     self.first, self.last, self.log_dir)

    def stop(self):
        """Stops a running capture (also when training ends inside the window)."""
        if self.running:
            tf.profiler.experimental.stop()
            self.running = False
