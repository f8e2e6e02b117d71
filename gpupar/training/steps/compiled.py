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

import keras
import numpy as np
import tensorflow as tf

from gpupar import keras_compat
from gpupar.errors import GpuparError
from gpupar.training.inner_loop import Results, unpack
from gpupar.training.loss import (checked_reductions, global_batch_losses, len_rows, replica_loss, resolved,
                                  summed_over_replicas, track_loss)
from gpupar.training.steps.parts import (accumulated, agreed_overflow, compiled_metrics_variables, forward,
                                         kept_if_skipped, loss_and_gradients, loss_scale_of, updated_metrics)
from gpupar.training.steps.kind import StepKind, StepRequest
from gpupar.training.steps.step import Step


class KerasCompiledStep(Step):
    """What every step of a compiled model shares: Keras' compiled loss over the global batch, its metrics carried.

    train_step() returns (the step's loss times its global batch's rows, this replica's rows), summed
    over steps and replicas: what the loop checks for a non-finite loss and counts as examples.
    test_step() returns this replica's rows. Both carry the compiled metrics' values as `states`.
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

    def test_zeros(self):
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

    def train_step(self, batch, states):
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

    def test_step(self, batch, states):
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


class CompiledKind(StepKind):
    """A compiled model trained by gpupar's step (CompiledStep): every model without a step of its own."""

    name = "compiled"

    def applies(self, model, placement) -> bool:
        return True

    def build(self, request: StepRequest) -> CompiledStep:
        check_compiled(request.model, request.train)
        options = request.options
        return CompiledStep(request.model, request.optimizer, request.update_optimizer, request.variables,
                            options.accumulate_steps, options.nan_policy == "skip", options.jit_compile)


def check_compiled(model, train):
    """Refuses a compiled loss whose reduction gpupar cannot take over the global batch, and labels outside a sparse
    cross-entropy's classes (checked_reductions, _check_labels)."""
    checked_reductions(model)
    _check_labels(model, train)


def _check_labels(model, train):
    """Refuses integer labels outside a sparse cross-entropy's classes, where the labels are in memory.

    For each output whose loss is Keras' sparse categorical cross-entropy (without an ignored
    class): TensorFlow raises on a CPU for such a label, but a GPU's kernel returns NaN, or a wrong
    loss, without a word.

    Raises:
      GpuparError: labels below 0 or not below the output's number of classes.
    """
    labels, outputs = train.labels(), getattr(model, "outputs", None)
    if labels is None or not outputs:
        return
    for path, loss in keras_compat.compiled_losses(model):
        if not _sparse(loss):
            continue
        try:
            own = np.asarray(resolved(labels, path) if len(outputs) > 1 else labels)
            classes = (resolved(model.output, path) if len(outputs) > 1 else outputs[0]).shape[-1]
        except (IndexError, KeyError, TypeError):  # labels laid out otherwise: Keras' CompileLoss matches them
            continue
        if classes is not None and own.size and np.issubdtype(own.dtype, np.number) and (
                own.min() < 0 or own.max() >= classes):
            raise GpuparError(f"the labels reach {own.min()}..{own.max()}, but the model has {classes} outputs "
                              f"(classes 0..{classes - 1}); fix the labels or the model's last layer")


def _sparse(loss) -> bool:
    """Whether a resolved Keras loss is sparse categorical cross-entropy (without an ignored class)."""
    if isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        return loss.get_config().get("ignore_class") is None
    return getattr(loss, "fn", None) is keras.losses.sparse_categorical_crossentropy
