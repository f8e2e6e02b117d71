"""TensorBoard scalars, under the logs' Keras names: the loss every display_step, every log per epoch."""

from typing import Optional

import tensorflow as tf


class Summaries:
    """Writes scalars to log_dir; with no log_dir, writes nothing.

    Tags: step/loss (and step/<metric>) at each progress line, by global step; epoch/<name> for
    each of the epoch's logs (loss, val_loss, accuracy, val_accuracy, ...), epoch/examples_per_second
    and epoch/input_wait_fraction, by epoch.
    """

    def __init__(self, log_dir: Optional[str]):
        self.writer = tf.summary.create_file_writer(log_dir) if log_dir else None

    def step(self, step: int, logs: dict):
        if self.writer is not None:
            with self.writer.as_default(step=step):
                for name, value in logs.items():
                    tf.summary.scalar(f"step/{name}", value)

    def epoch(self, epoch: int, record):
        if self.writer is not None:
            with self.writer.as_default(step=epoch):
                for name, value in record.logs.items():
                    tf.summary.scalar(f"epoch/{name}", value)
                tf.summary.scalar("epoch/examples_per_second", record.examples_per_second)
                tf.summary.scalar("epoch/input_wait_fraction", record.input_wait_fraction)
            self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()
