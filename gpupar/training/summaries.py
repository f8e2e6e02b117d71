"""TensorBoard scalars: train loss every display_step, epoch metrics after each epoch."""

from typing import Optional

import tensorflow as tf


class Summaries:
    """Writes scalars to log_dir; with no log_dir, writes nothing."""

    def __init__(self, log_dir: Optional[str]):
        self.writer = tf.summary.create_file_writer(log_dir) if log_dir else None

    def step(self, step: int, loss: float):
        if self.writer is not None:
            with self.writer.as_default(step=step):
                tf.summary.scalar("train/loss_step", loss)

    def epoch(self, epoch: int, record):
        if self.writer is not None:
            with self.writer.as_default(step=epoch):
                tf.summary.scalar("train/loss", record.train_loss)
                tf.summary.scalar("train/accuracy", record.train_accuracy)
                tf.summary.scalar("test/accuracy", record.test_accuracy)
                tf.summary.scalar("train/images_per_second", record.images_per_second)
                tf.summary.scalar("train/input_wait_fraction", record.input_wait_fraction)
            self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()
