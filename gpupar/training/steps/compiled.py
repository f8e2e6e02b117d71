"""The step of a compiled model: its loss over the GLOBAL batch, the gradients, one update, its metrics.

What Keras' own `Model.train_step` does, written for replicas: each replica's loss is its share
of the global batch's (gpupar.training.objective), so the optimizer's sum of the replicas'
gradients (Keras 3's apply all-reduces them) is the gradient of the whole batch. It trains
every data-parallel mode: replicas in sync, and each parameter-server worker on its own batch.
"""

import keras
import numpy as np
import tensorflow as tf

from gpupar.training.inner_loop import Results, unpack
from gpupar.training.objective import len_rows, summed_over_replicas
from gpupar.training.steps.parts import (accumulated, agreed_overflow, forward, kept_if_skipped, loss_and_gradients,
                                         loss_scale_of)
from gpupar.training.steps.step import Step


class ObjectiveStep(Step):
    """A step that trains the run's Objective (gpupar.training.objective): what its calls return and what they mean.

    train() returns (loss x examples, kept examples, examples, metric states) summed; evaluate()
    returns (loss numerators, denominators, metric states, added losses x examples, examples).
    Metrics that the model's layers own and update in their call are logged too, as model.fit
    logs them: reset when an epoch (or an evaluation) begins, summed over the replicas when read,
    and checkpointed, so that an epoch resumed mid-way reports the whole epoch.
    """

    def __init__(self, model, objective, optimizer):
        self.model, self.objective, self.optimizer = model, objective, optimizer
        self.layer_metrics = _layer_metrics(model)

    def state(self) -> dict:
        return {"step_state": [v for metric in self.layer_metrics for v in metric.variables]} if (
            self.layer_metrics) else {}

    def begin_epoch(self):
        for metric in self.layer_metrics:
            metric.reset_state()

    begin_evaluation = begin_epoch

    def _layer_results(self, prefix: str = "") -> dict:
        return {f"{prefix}{metric.name}": float(metric.result()) for metric in self.layer_metrics}

    def train_zeros(self):
        return 0.0, 0.0, 0.0, self.objective.zero_states()

    def eval_zeros(self):
        terms = np.zeros(len(self.objective.losses), np.float32)
        return terms, terms, self.objective.zero_states(), 0.0, 0.0

    def results(self, num_steps, totals, waited, busy) -> Results:
        loss, kept, examples, states = totals
        return Results(num_steps, float(loss), float(kept), float(examples), [np.asarray(s) for s in states], waited,
                       busy)

    def logs(self, totals) -> dict:
        """The loss is each output's weighted sum over the whole set divided by its whole denominator, plus the
        losses the model adds (averaged over the examples), as Keras' evaluate reports it."""
        numerators, denominators, states, added, rows = (np.asarray(t) if not isinstance(t, list) else t
                                                         for t in totals)
        loss = float(np.sum(np.divide(numerators, np.maximum(denominators, 1e-30))))
        loss += float(added) / max(float(rows), 1.0)
        logs = {"val_loss": loss}
        logs.update({f"val_{name}": value for name, value in self.objective.results([np.asarray(s) for s in states]).items()})
        logs.update(self._layer_results("val_"))
        return logs

    def metric_results(self, states) -> dict:
        return {**(self.objective.results(states) if states else {}), **self._layer_results()}

    def evaluated(self, y, y_pred, sample_weight, added, rows):
        """What evaluate() returns for one share of a batch, from its outputs and the losses the model added."""
        numerators, denominators = self.objective.terms(y, y_pred, sample_weight)
        rows = tf.cast(rows, tf.float32)
        added = tf.add_n(added) * rows if added else tf.constant(0.0)
        return numerators, denominators, self.objective.metric_states(y, y_pred, sample_weight), added, rows


def _layer_metrics(model) -> list:
    """The metrics that the model's layers own, those of a nested model's compile left out (as Keras' Model.metrics)."""
    found = []
    for layer in model.layers:
        found += _layer_metrics(layer) if isinstance(layer, keras.Model) else layer.metrics
    return found


class CompiledStep(ObjectiveStep):
    """The compiled model's step: forward, loss, gradients (over micro-batches), update, metrics.

    Attributes:
      variables: What the optimizer updates: the model's trainable variables, or their shards.
      accumulate_steps: Micro-batches whose gradients one update adds up.
      skip_nonfinite: nan_policy=skip: a step with a non-finite loss or gradient changes nothing.
      update_optimizer: What applies the updates: the optimizer, or a loss-scale optimizer around it.
    """

    def __init__(self, model, objective, optimizer, update_optimizer=None, variables=None, accumulate_steps: int = 1,
                 skip_nonfinite: bool = False, jit_compile: bool = False):
        super().__init__(model, objective, optimizer)
        self.update_optimizer = update_optimizer or optimizer
        self.variables = model.trainable_variables if variables is None else variables
        self.accumulate_steps, self.skip_nonfinite, self.jit_compile = accumulate_steps, skip_nonfinite, jit_compile
        self.loss_scale = loss_scale_of(self.update_optimizer)

    def train(self, batch):
        """One replica's step. The all-reduce of the gradients happens in the optimizer's apply (Keras 3 sums the
        replicas' gradients there); reducing them here as well would make every update num_replicas times too large."""
        x, y, sample_weight = unpack(batch)
        statistics = [v for v in self.model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating]
        before = [tf.identity(v) for v in statistics] if self.skip_nonfinite else []
        loss, states, grads = accumulated(self._gradients, self.accumulate_steps, x, y, sample_weight)
        rows = tf.cast(len_rows(x), tf.float32)  # this replica's share of the batch
        # The epoch's loss weighs each step's by its examples, as Keras' does (a last partial batch):
        # the replicas' shares times the whole batch's examples add up to its mean times them.
        weighted, kept = loss * summed_over_replicas(rows), rows
        if self.loss_scale is not None:
            grads, bad = agreed_overflow(grads, loss)
            if self.skip_nonfinite:
                weighted, states = kept_if_skipped(bad, statistics, before, weighted, states)
                kept = tf.where(bad, 0.0, kept)
        self.update_optimizer.apply(grads, self.variables)
        return weighted, kept, rows, states

    def _gradients(self, x, y, sample_weight, whole=None, total=None):
        return loss_and_gradients(self.model, self.objective, self.variables, x, y, sample_weight, self.loss_scale,
                                  1.0 / self.accumulate_steps, whole, total)

    def evaluate(self, batch):
        x, y, sample_weight = unpack(batch)
        y_pred, added = forward(self.model, x, training=False)
        return self.evaluated(y, y_pred, sample_weight, added, len_rows(x))

    def after_call(self):
        if self.skip_nonfinite:
            self.loss_scale.dynamic_scale.assign(1.0)  # each skipped step halved it
