"""Leaving a command without interpreter teardown.

Destroying a tf.data iterator whose pipeline runs tf.data's autotune blocks until its autotune
thread next wakes up (seen 5-35 s here, minutes for a whole test session). gpupar's pipelines run
without autotune (gpupar.data.array_pipeline.options), so a run's iterators go with the run; the
commands, and the test session, still end at once once everything is flushed, whatever the
user's pipelines hold.
"""

import os
import sys


def exit_without_teardown(status: int):
    """Flushes stdout and stderr, then ends the process at once with `status`.

    Only for the end of a command: everything worth keeping (checkpoints, summaries, JSON) is
    closed by then.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
