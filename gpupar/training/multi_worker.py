"""What changes for a task of a synchronous cluster (MultiWorkerMirroredStrategy).

Every worker runs the same loop in lock step; only the chief keeps what it writes. As TF
recommends, the others still save (checkpoint saving may need all workers) but into a scratch
folder that is removed at the end, and they write no TensorBoard summaries or metrics file.
"""

import dataclasses
import logging
import os
import shutil
import signal
import tempfile

import tensorflow as tf

from gpupar.runtime.cluster import Cluster
from gpupar.errors import GpuparError

log = logging.getLogger("gpupar")


def worker_outputs(outputs, cluster: Cluster):
    """The OutputOptions a non-chief worker runs with: no summaries, no metrics file."""
    if cluster.is_chief:
        return outputs
    return dataclasses.replace(outputs, log_dir=None, metrics_json=None)


class ScratchDir:
    """A non-chief worker's folder for the checkpoints it must save but nobody keeps.

    It is model_dir/.scratch-worker-N (TF's own pattern): removed at the end, and at the start
    too, so a worker that was killed leaves nothing behind after its restart.
    """

    def __init__(self, cluster: Cluster, model_dir, save: bool = True):
        self.path = None
        if save and not cluster.is_chief:
            name = f".scratch-{cluster.task_type}-{cluster.task_index}"
            # Without a model_dir of its own (the chief numbers its run folder), a temporary one.
            self.path = os.path.join(model_dir, name) if model_dir else tempfile.mkdtemp(prefix=f"gpupar{name}-")

    def __enter__(self):
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            os.makedirs(self.path)
        return self

    def __exit__(self, *exc):
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        return False


class AgreedStop:
    """A stop request that all workers agree on: `signum` is the signal any worker has seen.

    Each worker checks it at the same points of the loop, so they all stop after the same step
    and save the same checkpoint; a worker stopping alone would leave the others waiting in their
    next all-reduce. Each check is one scalar all-reduce (a SUM: tf.distribute has no MAX) across
    the workers; a worker that saw no signal itself reports the one the sum names, else SIGTERM.
    """

    def __init__(self, local, strategy):
        self.local, self.strategy = local, strategy
        self._seen = None

        @tf.function(autograph=False)
        def any_signal(value):
            per_replica = strategy.run(lambda: tf.identity(value))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        self._any_signal = any_signal

    @property
    def signum(self):
        if self._seen is None:
            total = int(self._any_signal(tf.constant(self.local.signum or 0, tf.int32)))
            if total:
                self._seen = self.local.signum or (total if total in (signal.SIGINT, signal.SIGTERM) else signal.SIGTERM)
        return self._seen


def lost_peer(error: Exception, cluster: Cluster, checkpoint) -> GpuparError:
    """The error a worker reports when the cluster broke under it (a peer died or hung)."""
    last_saved = f"the last checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written yet"
    return GpuparError(
        f"{cluster.task_name} lost the cluster ({type(error).__name__}: {str(error).splitlines()[0][:200]}); "
        f"{last_saved}. Restart every task with --resume (gpupar launch --restarts=N does it)"
    )
