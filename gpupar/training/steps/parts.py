"""The pieces that several kinds of step share, each written once as a plain function.

`forward` (the model's call on one replica, its added losses read at once), `updated_metrics`
(Keras' own updates of the compiled metrics, into the states the steps carry),
`loss_and_gradients` (one batch's share of the global loss, its gradients, Keras' metrics
updated), `accumulated` (N micro-batches, one update), `agreed_overflow` (a loss-scale
optimizer's skip, alike on every replica) and `kept_if_skipped` (nan_policy=skip leaves the
statistics as they were).
"""

import keras
import tensorflow as tf

from gpupar import keras_compat
from gpupar.training.inner_loop import all_finite
from gpupar.training.loss import len_rows, micro_batch, replica_loss, summed_over_replicas


def forward(model, x, training: bool):
    """(the model's outputs, the losses it added in this call), on this replica.

    The added losses (add_loss, weight penalties) are read right after the call: `model.losses`
    is one list that every replica's call refills, so it must be read before this replica waits
    on the others (an all-reduce). They are this replica's own values: a Keras loss object called
    inside the model (add_loss(loss_fn(y, logits)), keras-io's endpoint layer) does not divide by
    the replica count here, since gpupar divides every added loss once (loss.replica_loss); Keras'
    fit divides such a loss twice. Keras' random layers draw apart on each replica
    (keras_compat.per_replica_semantics). The outputs keep their Keras masks, which the losses
    and metrics read.
    """
    with keras_compat.in_replica():
        y_pred = model(x, training=training)
        added = list(model.losses)
    return y_pred, added


def compiled_metrics_variables(model) -> list:
    """The variables of the metrics a compiled model's own step updates: the "loss" log's, compile's metrics', and the
    per-output losses' (Keras' Trainer.metrics less those the model's layers own and update in their call)."""
    metrics = [keras_compat.loss_tracker(model), keras_compat.compile_metrics(model)]
    compiled = keras_compat.compile_loss(model)
    metrics += list(compiled.metrics) if compiled is not None else []
    return [v for metric in metrics if metric is not None for v in metric.variables]


def updated_metrics(variables, states, update):
    """(update()'s result, the new states): update() run with the metric variables reading and writing `states`.

    Keras' own metric code updates the metrics (update_state, compute_metrics); Keras'
    StatelessScope (the one its JAX trainer runs every step in) lets it read the variables from
    the states this replica carries and keeps what it writes there, so each replica updates its
    own, whatever the strategy does with the variables; the call's end combines them
    (gpupar.training.inner_loop.carried_into).
    """
    with keras.StatelessScope(state_mapping=list(zip(variables, states))) as scope:
        result = update()
    return result, [scope.get_current_value(v) for v in variables]


def loss_and_gradients(model, variables, x, y, sample_weight, metrics, states, loss_scale=None,
                       added_share: float = 1.0):
    """(this replica's share of the global loss, the gradients of `variables`, the new metric states) of one batch.

    The loss is Keras' compiled loss over the global batch plus this replica's part of the
    losses the model added (gpupar.training.loss.replica_loss), `added_share` of them (1/N for N
    micro-batches). A loss-scale optimizer (`loss_scale`) scales what is differentiated. The
    compiled metrics (`metrics`, their values `states`) are updated by Keras' own code: the
    per-output losses in the compiled loss, the others in compute_metrics, on this replica's outputs.
    """
    with tf.GradientTape() as tape:
        y_pred, added = forward(model, x, training=True)
        (loss, share), states = updated_metrics(metrics, states, lambda: replica_loss(
            model, y, y_pred, sample_weight, added, added_share))
        differentiated = loss_scale.scale_loss(loss) if loss_scale is not None else loss
    grads = tape.gradient(differentiated, variables)
    _, states = updated_metrics(metrics, states, lambda: model.compute_metrics(x, y, y_pred, sample_weight))
    return share, grads, states


def accumulated(gradients, accumulate_steps: int, x, y, sample_weight, states):
    """(loss share, gradients, metric states) of accumulate_steps micro-batches of this replica's batch, added up.

    `gradients(x, y, sample_weight, states, added_share)` is one micro-batch's
    loss_and_gradients. Each replica splits its share of the batch into N micro-batches, runs
    forward and backward on them one after another (one holds its activations at a time: each
    micro-batch's slice of the batch waits for the gradients before it) and adds up their
    gradients. Each micro-batch's loss is divided by the whole batch's denominators
    (gpupar.training.loss.micro_batch), so the sum is the gradient of one step on the whole batch
    (exactly so for a model without batch norm, which normalises each micro-batch on its own, and
    without masks that count differently in each micro-batch). The micro-batches are written out
    one after another, not as a tf.while_loop: their denominators are all-reduced over the
    replicas, which a replica's step may not do inside a loop of its own (MirroredStrategy's
    merge_call).
    """
    if accumulate_steps == 1:
        return gradients(x, y, sample_weight, states, 1.0)
    rows = len_rows(x)
    loss, summed = 0.0, None
    for m in range(accumulate_steps):
        with tf.control_dependencies([g for g in summed or () if g is not None]):
            lower, upper = (m * rows) // accumulate_steps, ((m + 1) * rows) // accumulate_steps
            parts = [None if part is None else tf.nest.map_structure(lambda t: t[lower:upper], part)
                     for part in (x, y, sample_weight)]
        with micro_batch(upper - lower, rows, sample_weight):
            share, grads, states = gradients(*parts, states, 1.0 / accumulate_steps)
        loss += share
        summed = list(grads) if summed is None else [
            None if g is None else tf.convert_to_tensor(g) if total is None else total + tf.convert_to_tensor(g)
            for total, g in zip(summed, grads)]
    return loss, summed, states


def agreed_overflow(grads, loss):
    """(the gradients, NaN on every replica where any replica's are not finite; whether they were not).

    A keras.optimizers.LossScaleOptimizer skips a step with non-finite gradients, but decides from
    one replica's: poisoning every replica's makes them all agree, and skip the same step.
    """
    finite = all_finite([g for g in grads if g is not None] + [loss])
    bad = summed_over_replicas(1.0 - tf.cast(finite, tf.float32)) > 0
    return [None if g is None else tf.where(bad, tf.constant(float("nan"), g.dtype), g) for g in grads], bad


def kept_if_skipped(bad, variables, before, states, states_before):
    """nan_policy=skip: on a skipped step, the variables (batch-norm statistics) put back, the metric states as they were.

    Returns the metric states to carry on with.
    """
    for variable, value in zip(variables, before):
        variable.assign(tf.where(bad, value, variable))
    return [tf.where(bad, old, new) for old, new in zip(states_before, states)]


def loss_scale_of(optimizer):
    """The optimizer if it is a loss-scale optimizer (its scale_loss scales what is differentiated), else None."""
    return optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None


def finite_check(model):
    """A tf.function telling whether every float weight of the model is finite."""
    weights = [w for w in model.weights if tf.as_dtype(w.dtype).is_floating]
    return tf.function(lambda: all_finite(weights), autograph=False)
