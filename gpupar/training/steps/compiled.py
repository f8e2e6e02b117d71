"""The step of a compiled model: Keras' train_step, its loss over the GLOBAL batch.

What Keras' own `train_step` does (forward, the compiled loss, gradients, one update, the
compiled metrics by Keras' `compute_metrics`), with one change: each replica's loss is its share
of the global batch's (gpupar.training.loss), so the optimizer's sum of the replicas' gradients
(Keras 3's apply all-reduces them) is the gradient of the whole batch, masks included. It trains
every data-parallel mode: replicas in sync, and each parameter-server worker on its own batch.
The metrics are Keras' own variables, summed over the replicas as Keras declares them; the
host reads them as Keras' fit does (Step.logs).
"""

import contextlib

import tensorflow as tf

from gpupar.training.inner_loop import Results, unpack
from gpupar.training.loss import global_batch_losses, len_rows, replica_loss, summed_over_replicas, track_loss
from gpupar.training.steps.parts import (accumulated, agreed_overflow, compiled_metrics_variables, forward,
                                         kept_if_skipped, loss_and_gradients, loss_scale_of, updated_metrics)
from gpupar.training.steps.step import Step


class KerasCompiledStep(Step):
    """What every step of a compiled model shares: Keras' compiled loss over the global batch, its metrics carried.

    train() returns (the step's loss times its global batch's rows, this replica's rows), summed
    over steps and replicas: what the loop checks for a non-finite loss and counts as examples.
    evaluate() returns this replica's rows. Both carry the compiled metrics' values as `states`.
    """

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.metrics = compiled_metrics_variables(model)

    @property
    def state_variables(self) -> list:
        return self.metrics

    @contextlib.contextmanager
    def in_call(self):
        """Keras' per-replica semantics, and the compiled losses reduced over the global batch."""
        with super().in_call(), global_batch_losses(self.model):
            yield

    def train_zeros(self):
        return 0.0, 0.0

    def eval_zeros(self):
        return 0.0

    def results(self, num_steps, totals, waited, busy) -> Results:
        loss, examples = totals
        return Results(num_steps, float(loss), float(examples), waited, busy)


class CompiledStep(KerasCompiledStep):
    """The compiled model's step: forward, loss, gradients (over micro-batches), update, metrics.

    Attributes:
      variables: What the optimizer updates: the model's trainable variables, or their shards.
      accumulate_steps: Micro-batches whose gradients one update adds up.
      skip_nonfinite: nan_policy=skip: a step with a non-finite loss or gradient changes nothing.
      update_optimizer: What applies the updates: the optimizer, or a loss-scale optimizer around it.
    """

    def __init__(self, model, optimizer, update_optimizer=None, variables=None, accumulate_steps: int = 1,
                 skip_nonfinite: bool = False, jit_compile: bool = False):
        super().__init__(model, optimizer)
        self.update_optimizer = update_optimizer or optimizer
        self.variables = model.trainable_variables if variables is None else variables
        self.accumulate_steps, self.skip_nonfinite, self.jit_compile = accumulate_steps, skip_nonfinite, jit_compile
        self.loss_scale = loss_scale_of(self.update_optimizer)

    def train(self, batch, states):
        """One replica's step. The all-reduce of the gradients happens in the optimizer's apply (Keras 3 sums the
        replicas' gradients there); reducing them here as well would make every update num_replicas times too large."""
        x, y, sample_weight = unpack(batch)
        statistics = [v for v in self.model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating
                      and not any(v is m for m in self.metrics)] if self.skip_nonfinite else []
        before, states_before = [tf.identity(v) for v in statistics], list(states)
        loss, grads, states = accumulated(self._gradients, self.accumulate_steps, x, y, sample_weight, states)
        rows = tf.cast(len_rows(x), tf.float32)  # this replica's share of the batch
        _, states = updated_metrics(self.metrics, states, lambda: track_loss(self.model, loss, rows))
        # The epoch's loss weighs each step's by its examples, as Keras' does (a last partial batch).
        weighted = loss * summed_over_replicas(rows)
        if self.loss_scale is not None:
            grads, bad = agreed_overflow(grads, loss)
            if self.skip_nonfinite:
                states = kept_if_skipped(bad, statistics, before, states, states_before)
                weighted = tf.where(bad, 0.0, weighted)
        self.update_optimizer.apply(grads, self.variables)
        return (weighted, rows), states

    def _gradients(self, x, y, sample_weight, states, added_share):
        return loss_and_gradients(self.model, self.variables, x, y, sample_weight, self.metrics, states,
                                  self.loss_scale, added_share)

    def evaluate(self, batch, states):
        """One replica's evaluation of its share: Keras' test_step, its loss over the global batch."""
        x, y, sample_weight = unpack(batch)
        y_pred, added = forward(self.model, x, training=False)
        rows = tf.cast(len_rows(x), tf.float32)

        def test_step():
            _, share = replica_loss(self.model, y, y_pred, sample_weight, added)
            track_loss(self.model, share, rows)
            self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

        _, states = updated_metrics(self.metrics, states, test_step)
        return rows, states

    def after_call(self):
        if self.skip_nonfinite:
            self.loss_scale.dynamic_scale.assign(1.0)  # each skipped step halved it
