"""A compiled model's loss as Keras computes it, reduced over the GLOBAL batch; and the loss Keras logs.

Keras' compile resolves the loss (a name, a function or a keras.losses.Loss, one per output,
loss_weights, a None loss for an output) into a CompileLoss of Loss objects. Inside a strategy
each replica's Loss divides its own masked, weighted sum by its own count and by the replica
count, so the replicas' sum is the mean of their means: not one device's number wherever the
replicas count differently (masks, ignore_class, sample weights, an uneven last batch). gpupar
keeps Keras' CompileLoss and each Loss's own call and changes only the denominator: for the run,
each of the CompileLoss's losses is a GlobalBatchLoss that divides this replica's sum by the
count over all replicas (one scalar all-reduce), so the replicas' shares add up to the global
batch's loss and their gradients, which the optimizer sums, to its gradient.

Micro-batches (gradient accumulation, the pipelined stages) are parts of one batch: each part's
share is divided by the whole batch's count, taken as the part's count times the whole batch's
rows over the part's (its sample weights' sum over the part's, for "mean_with_sample_weight"):
exact wherever every row counts as many values (no mask), as for the weights themselves.
"""

import contextlib
import logging
import threading

import keras
import tensorflow as tf

from gpupar import keras_compat
from gpupar.errors import GpuparError

log = logging.getLogger("gpupar")
SUM = tf.distribute.ReduceOp.SUM
REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight", "sum")


def summed_over_replicas(value):
    """value summed over the replicas in sync (itself where there is one: a parameter-server worker, one device)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    return context.all_reduce(SUM, value)


def len_rows(structure):
    """The rows (examples) of a batch: the first dimension of its first tensor."""
    first = next(t for t in tf.nest.flatten(structure, expand_composites=True) if t is not None)
    return tf.shape(first)[0]


class _Parts(threading.local):
    """What this thread's replica is computing: a whole batch (parts None) or one part of it; the shares so far."""

    parts = None  # (the whole batch's rows / this part's, the whole batch's sample weights) for a micro-batch
    shares = None  # the shares the losses called so far added, each times its loss_weight


_PARTS = _Parts()


@contextlib.contextmanager
def micro_batch(rows, whole_rows, whole_sample_weight=None):
    """While open, this thread's losses are one micro-batch's of a whole batch (this replica's share of it).

    rows, whole_rows: the rows of the part and of the whole; whole_sample_weight: the whole's
    sample weights (structured as given), for losses that divide by their sum.
    """
    before = _PARTS.parts
    _PARTS.parts = (tf.cast(whole_rows, tf.float32) / tf.cast(tf.maximum(rows, 1), tf.float32), whole_sample_weight)
    try:
        yield
    finally:
        _PARTS.parts = before


def resolved(structure, path):
    """The part of a nested structure at `path` (a CompileLoss path); the structure itself where it is not nested."""
    if not tf.nest.is_nested(structure):
        return structure
    for key in path:
        structure = structure[key]
    return structure


class GlobalBatchLoss(keras.losses.Loss):
    """One of a compiled model's losses, reduced over the global batch: Keras' call and masks, gpupar's denominator.

    Its value is this replica's share: the loss's masked, weighted sum here divided by its count
    over all replicas ("sum": the sum here). Its gradient is that of the share; within a micro-batch
    its value is the micro-batch's own mean over the replicas (what Keras' per-output loss
    metrics record), while the share is what it adds to the step's loss (`shares`).

    Attributes:
      loss: The keras.losses.Loss it reduces.
      path: Where its outputs, labels and sample weights are in theirs (CompileLoss's path).
      weight: Its loss_weight (None: 1).
    """

    def __init__(self, loss, path=(), weight=None):
        super().__init__(name=loss.name, reduction=loss.reduction, dtype=loss.dtype)
        self.loss, self.path, self.weight = loss, tuple(path), weight
        self.said = False  # whether the log said that it gives one value per batch

    def __call__(self, y_true, y_pred, sample_weight=None):
        total, count, per_batch = keras_compat.loss_sums(self.loss, y_true, y_pred, sample_weight)
        total, count = tf.cast(total, tf.float32), tf.cast(count, tf.float32)
        context = tf.distribute.get_replica_context()
        if per_batch and context is not None and context.num_replicas_in_sync > 1 and not self.said:
            self.said = True  # when the step is traced
            log.info("loss %r gives one value per batch, not one per example: on several replicas the step's loss is "
                     "the mean of each replica's value (as model.fit's under a strategy), not the global batch's",
                     self.loss.name)
        if self.reduction == "sum":
            share = shown = total
        else:
            shown = tf.math.divide_no_nan(total, summed_over_replicas(count))
            share = shown if _PARTS.parts is None else tf.math.divide_no_nan(
                total, summed_over_replicas(count * self._whole_over_part(sample_weight)))
        if _PARTS.shares is not None:
            _PARTS.shares.append(share * (1.0 if self.weight is None else self.weight))
        return share if shown is share else share + tf.stop_gradient(shown - share)

    def _whole_over_part(self, sample_weight):
        """How many times this micro-batch's count the whole batch's is taken to be (this replica's)."""
        rows_ratio, whole_weight = _PARTS.parts
        if self.reduction != "mean_with_sample_weight" or sample_weight is None or whole_weight is None:
            return rows_ratio
        whole = tf.reduce_sum(tf.cast(resolved(whole_weight, self.path), tf.float32))
        return tf.math.divide_no_nan(whole, tf.reduce_sum(tf.cast(sample_weight, tf.float32)))


def checked_reductions(model):
    """Refuses a compiled loss whose reduction leaves it unreduced (gpupar averages over the global batch).

    Raises:
      GpuparError: a loss with reduction None or "none".
    """
    for _, loss in keras_compat.compiled_losses(model):
        if loss.reduction not in REDUCTIONS:
            raise GpuparError(f"loss {loss.name!r}: reduction={loss.reduction!r} leaves the loss unreduced; gpupar "
                              f"averages it over the global batch as its reduction says: use one of "
                              f"{', '.join(REDUCTIONS)}")


@contextlib.contextmanager
def global_batch_losses(model):
    """While open, the model's compiled losses reduce over the global batch (GlobalBatchLoss)."""
    with keras_compat.compile_losses_replaced(model, GlobalBatchLoss):
        yield


def replica_loss(model, y, y_pred, sample_weight, added=(), added_share: float = 1.0):
    """(what this replica differentiates, its share of the global batch's loss) for one batch or micro-batch.

    The compiled losses (global_batch_losses must be open) plus this replica's part of the losses
    the model added in its call (`added`, read right after it), each divided by the replica count
    as Keras divides them, times added_share (1/N for N micro-batches, so that they add them
    once). The two differ only within a micro-batch (GlobalBatchLoss).
    """
    compiled = keras_compat.compile_loss(model)
    _PARTS.shares, shares = [], None
    try:
        value = compiled(y, y_pred, sample_weight) if compiled is not None else None
        shares = _PARTS.shares
    finally:
        _PARTS.shares = None
    if value is None and not added:  # as Keras' compute_loss refuses it, when the step is traced
        raise GpuparError("the model has no loss: compile it with one in model_fn (model.compile(loss=...)) or pass "
                          "loss=..., or add one in the model (self.add_loss)")
    loss = tf.constant(0.0) if value is None else tf.cast(value, tf.float32)
    share = tf.add_n(shares) if shares else tf.constant(0.0)
    if added:
        extra = tf.nn.scale_regularization_loss(tf.add_n([tf.cast(a, tf.float32) for a in added])) * added_share
        loss, share = loss + extra, share + extra
    return loss, share


def track_loss(model, share, rows):
    """Adds one step's loss to the model's loss metric (Keras' "loss" log), weighed by the global batch's rows.

    Keras' train_step adds each replica's loss times its replica count, weighed by its rows; here
    each replica adds its share times the global batch's rows, weighed by its own, so that the
    metric's sums over the replicas are the global loss times the global rows, and those rows.
    """
    tracker = keras_compat.loss_tracker(model)
    if tracker is None:
        return
    rows = tf.cast(rows, tf.float32)
    tracker.update_state(tf.math.divide_no_nan(share * summed_over_replicas(rows), rows), sample_weight=rows)
