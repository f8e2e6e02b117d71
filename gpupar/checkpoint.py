"""Per-epoch checkpoints of model, optimizer and epoch counter, and resuming from them."""

import logging
from typing import Optional

import tensorflow as tf

from gpupar.errors import GpuparError

log = logging.getLogger("gpupar")


class Checkpoints:
    """Saves after each epoch into model_dir (ckpt-N holds the state after N epochs) and restores.

    Checkpoints store one copy of each variable, so a checkpoint written with N replicas restores
    into any other replica count.
    """

    def __init__(self, model_dir: Optional[str], model, optimizer, max_to_keep: Optional[int] = None):
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=self.epoch)
        self.manager = None
        if model_dir is not None:
            self.manager = tf.train.CheckpointManager(self.checkpoint, model_dir, max_to_keep=max_to_keep)

    def restore(self, resume) -> int:
        """Restores per `resume` (False, True for the latest, or a path) and returns epochs done."""
        if resume is False:
            return 0
        path = resume if isinstance(resume, str) else self.manager.latest_checkpoint
        if path is None:
            log.info("resume: no checkpoint in %s yet, starting from scratch", self.manager.directory)
            return 0
        try:
            self.checkpoint.restore(path).assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as e:
            raise GpuparError(
                f"{path}: cannot restore this checkpoint into the model ({type(e).__name__}: "
                f"{str(e).splitlines()[0]}); it was written by another model or is damaged"
            ) from None
        done = int(self.epoch.numpy())
        log.info("resumed from %s after %d epoch(s)", path, done)
        return done

    def save(self, epochs_done: int) -> Optional[str]:
        """Writes ckpt-<epochs_done>; returns its path, or None without a model_dir."""
        if self.manager is None:
            return None
        self.epoch.assign(epochs_done)
        return self.manager.save(checkpoint_number=epochs_done)
