"""Working around TensorFlow 2.21's slow teardown of distributed tf.data iterators.

Destroying one blocks until its tf.data autotune thread next wakes up, which after a few minutes
of training is tens of seconds (seen 5-35 s here, minutes for a whole test session). gpupar keeps
its iterators for the life of the process, and its commands leave without interpreter teardown.
"""

import os
import sys

_KEPT = []


def keep_for_process(iterator):
    """Keeps an iterator alive until the process ends, and returns it."""
    _KEPT.append(iterator)
    return iterator


def exit_without_teardown(status: int):
    """Flushes stdout and stderr, then ends the process at once with `status`.

    Only for the end of a command: everything worth keeping (checkpoints, summaries, JSON) is
    closed by then.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
