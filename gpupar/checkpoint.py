"""Checkpoints of model, optimizer and position (epoch, step), and resuming from them."""

import dataclasses
import logging
import os
from typing import Optional

import tensorflow as tf

from gpupar.errors import GpuparError

log = logging.getLogger("gpupar")
WITHIN_EPOCH = "within_epoch"


@dataclasses.dataclass(frozen=True)
class Position:
    """Where training stands: `epoch` epochs complete, plus `step` steps of the next one.

    `global_batch` is the batch those steps had (0 where unknown: nothing restored yet).
    """

    epoch: int = 0
    step: int = 0
    global_batch: int = 0

    def rebatched(self, global_batch: int, steps_per_epoch: int) -> "Position":
        """The same point for a run with another global batch or epoch length.

        Mid-epoch, the examples already seen decide the step; the data order from there on is
        then not the one an uninterrupted run would have seen.
        """
        step = self.step
        if step and self.global_batch and self.global_batch != global_batch:
            step = step * self.global_batch // global_batch
        return Position(self.epoch, min(step, steps_per_epoch - 1) if step else 0, global_batch)


class Checkpoints:
    """Writes ckpt-N after epoch N into model_dir, and step checkpoints within an epoch.

    Step checkpoints (for checkpoint_every_steps and interruptions) go to model_dir/within_epoch,
    which keeps only the newest. Each save writes its files first and then atomically replaces
    the small index file that names the latest one, so a process killed at any moment leaves the
    previous checkpoint readable. A checkpoint stores one copy of each variable, so one written
    with N replicas restores into any other replica count.
    """

    def __init__(self, model_dir: Optional[str], model, optimizer, max_to_keep: Optional[int] = None,
                 global_batch: int = 0):
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step_in_epoch")
        self.global_batch = tf.Variable(global_batch, dtype=tf.int64, trainable=False, name="global_batch")
        self.run_global_batch = global_batch
        self.checkpoint = tf.train.Checkpoint(
            model=model, optimizer=optimizer, epoch=self.epoch, step=self.step, global_batch=self.global_batch
        )
        self.epochs = self.steps = None
        if model_dir is not None:
            self.epochs = tf.train.CheckpointManager(self.checkpoint, model_dir, max_to_keep=max_to_keep)
            self.steps = tf.train.CheckpointManager(
                self.checkpoint, os.path.join(model_dir, WITHIN_EPOCH), max_to_keep=1, checkpoint_name="step"
            )
        self.latest = None

    def write_to(self, directory: str):
        """Saves into `directory` from now on (a non-chief worker's scratch folder, after restoring)."""
        if self.epochs is not None:
            self.epochs = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=1)
            self.steps = tf.train.CheckpointManager(
                self.checkpoint, os.path.join(directory, WITHIN_EPOCH), max_to_keep=1, checkpoint_name="step"
            )

    @staticmethod
    def _unreadable(path, error):
        return GpuparError(
            f"{path}: cannot restore this checkpoint into the model ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}); it was written by another model or is damaged. "
            "Nothing was changed on disk; resume from an older checkpoint or use a new model_dir"
        )

    def _position_in(self, path) -> tuple:
        """(epoch, step) stored in a checkpoint, read without restoring it."""
        try:
            reader = tf.train.load_checkpoint(path)
            return tuple(int(reader.get_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE")) for name in ("epoch", "step"))
        except (IndexError, ValueError, tf.errors.OpError) as e:
            raise self._unreadable(path, e) from None

    def restore(self, resume) -> Position:
        """Restores per `resume` (False, True for the one further along in model_dir, or a path)."""
        if resume is False:
            return Position()
        if isinstance(resume, str):
            path = resume
        else:
            candidates = [p for p in (self.epochs.latest_checkpoint, self.steps.latest_checkpoint) if p]
            if not candidates:
                log.info("resume: no checkpoint in %s yet, starting from scratch", self.epochs.directory)
                return Position()
            path = max(candidates, key=self._position_in)
        try:
            self.checkpoint.restore(path).assert_existing_objects_matched()
        except (AssertionError, IndexError, ValueError, tf.errors.OpError) as e:
            raise self._unreadable(path, e) from None
        position = Position(int(self.epoch.numpy()), int(self.step.numpy()), int(self.global_batch.numpy()))
        self.latest = path
        log.info("resumed from %s after %d epoch(s) and %d step(s)", path, position.epoch, position.step)
        return position

    def _save(self, manager, number, position: Position) -> Optional[str]:
        if manager is None:
            return None
        self.epoch.assign(position.epoch)
        self.step.assign(position.step)
        self.global_batch.assign(self.run_global_batch)
        try:
            self.latest = manager.save(checkpoint_number=number)
        except (OSError, tf.errors.OpError) as e:
            kept = f"the last complete checkpoint {self.latest} is intact" if self.latest else "no checkpoint was written before"
            raise GpuparError(
                f"could not write a checkpoint into {manager.directory} ({type(e).__name__}: "
                f"{str(e).splitlines()[0]}); {kept}. Free space or fix permissions, then resume"
            ) from None
        return self.latest

    def save_epoch(self, epochs_done: int) -> Optional[str]:
        """Writes ckpt-<epochs_done>; returns its path, or None without a model_dir."""
        return self._save(self.epochs, epochs_done, Position(epochs_done, 0))

    def save_step(self, position: Position, global_step: int) -> Optional[str]:
        """Writes a within-epoch checkpoint at `position`; returns its path."""
        return self._save(self.steps, global_step, position)


class ModelDirLock:
    """Holds an exclusive lock on model_dir for one run, so two runs never write it at once.

    The lock is an flock on model_dir/.gpupar.lock: the operating system drops it when the
    process dies, even by SIGKILL, so a crashed run never blocks the next one.
    """

    def __init__(self, model_dir: Optional[str]):
        self.model_dir = model_dir
        self.file = None

    def __enter__(self):
        if self.model_dir is None:
            return self
        import fcntl

        path = os.path.join(self.model_dir, ".gpupar.lock")
        try:
            os.makedirs(self.model_dir, exist_ok=True)
            self.file = open(path, "a+")
        except OSError as e:
            raise GpuparError(
                f"model_dir={self.model_dir!r} cannot be written ({e.strerror}); choose a folder you "
                "can write, or fix its permissions"
            ) from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.seek(0)
            owner = self.file.read().strip() or "unknown"
            self.file.close()
            raise GpuparError(
                f"model_dir={self.model_dir!r} is in use by another gpupar run (pid {owner}); wait for "
                "it to finish or use another model_dir"
            ) from None
        self.file.truncate(0)
        self.file.write(str(os.getpid()))
        self.file.flush()
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()
        return False
