"""The pieces that several kinds of step share, each written once as a plain function.

`as_float32` (the outputs the loss and metrics read), `forward` (the
model's call, its added losses read at once), `loss_and_gradients` (one batch's share of the
global loss and its gradients), `accumulated` (N micro-batches, one update), `agreed_overflow`
(a loss-scale optimizer's skip, alike on every replica) and `kept_if_skipped` (nan_policy=skip
leaves the statistics and sums as they were).
"""

import threading

import keras
import tensorflow as tf

from gpupar.models.layers import replica_seeds
from gpupar.training.inner_loop import all_finite
from gpupar.training.objective import len_rows, summed_over_replicas


def as_float32(y_pred):
    """The model's outputs in float32 (16-bit under mixed precision), as the losses and metrics read them."""
    return tf.nest.map_structure(lambda t: tf.cast(t, tf.float32), y_pred)


def forward(model, x, training: bool):
    """(the model's outputs in float32, the losses it added in this call).

    The added losses (add_loss, weight penalties) are read right after the call: `model.losses`
    is one list that every replica's call refills, so it must be read before this replica waits
    on the others (an all-reduce). They are this replica's own values: a Keras loss object called
    inside the model (add_loss(loss_fn(y, logits)), keras-io's endpoint layer) does not divide by
    the replica count here, since gpupar divides every added loss once (loss_and_gradients); Keras'
    fit divides such a loss twice. Keras' random layers draw apart on each replica.
    """
    _install_per_replica_losses()
    _PER_REPLICA.depth = getattr(_PER_REPLICA, "depth", 0) + 1
    try:
        with replica_seeds():
            y_pred = model(x, training=training)
    finally:
        _PER_REPLICA.depth -= 1
    added = list(model.losses)
    return as_float32(y_pred), added


_PER_REPLICA = threading.local()  # how deep in forward() this thread (a replica's) is
_INSTALL = threading.Lock()


def _install_per_replica_losses():
    """Wraps Keras' scale_loss_for_distribution, once per process, to leave a loss as it is inside forward().

    Keras' loss objects divide their value by the strategy's replica count as they reduce it
    (keras/src/losses/loss.py, reduce_values, which looks the function up in its module when it
    runs); MirroredStrategy runs each replica in a thread of its own, so forward() says per thread
    that it runs.
    """
    from keras.src.losses import loss as keras_loss

    with _INSTALL:
        scale = keras_loss.scale_loss_for_distribution
        if getattr(scale, "gpupar_per_replica", False):
            return

        def scale_outside_forward(value):
            return value if getattr(_PER_REPLICA, "depth", 0) else scale(value)

        scale_outside_forward.gpupar_per_replica = True
        keras_loss.scale_loss_for_distribution = scale_outside_forward


def loss_and_gradients(model, objective, variables, x, y, sample_weight, loss_scale=None,
                       regularisation_share: float = 1.0, whole=None, total=None):
    """(this replica's loss share, metric states, gradients of `variables`, the global denominators) of one batch.

    The loss is this replica's share of the global batch's (gpupar.training.objective: `whole`
    and `total` give a micro-batch the whole batch's denominators) plus its share of the losses
    the model added, times `regularisation_share` (1/N for N micro-batches, so that they add
    them once). A loss-scale optimizer (`loss_scale`) scales what is differentiated.
    """
    with tf.GradientTape() as tape:
        y_pred, added = forward(model, x, training=True)
        loss, total = objective.replica_loss(y, y_pred, sample_weight, whole, total)
        if added:  # each replica adds its share; the replicas' sum adds them once
            loss += tf.nn.scale_regularization_loss(tf.add_n(added)) * regularisation_share
        differentiated = loss_scale.scale_loss(loss) if loss_scale is not None else loss
    grads = tape.gradient(differentiated, variables)
    return loss, objective.metric_states(y, y_pred, sample_weight), grads, total


def accumulated(gradients, accumulate_steps: int, x, y, sample_weight):
    """(loss share, metric states, gradients) of accumulate_steps micro-batches of this replica's batch, added up.

    `gradients(x, y, sample_weight, whole=None, total=None)` is one micro-batch's
    loss_and_gradients. Each replica splits its share of the batch into N micro-batches, runs
    forward and backward on them one after another (one holds its activations at a time) and
    adds up their gradients. The first micro-batch gives the whole global batch's loss
    denominators and the others divide by them too, so the sum is the gradient of one step on
    the whole batch (exactly so for a model without batch norm, which normalises each
    micro-batch on its own).
    """
    if accumulate_steps == 1:
        return gradients(x, y, sample_weight)[:3]
    rows = len_rows(x)

    def micro(m):
        lower, upper = (m * rows) // accumulate_steps, ((m + 1) * rows) // accumulate_steps
        return [None if part is None else tf.nest.map_structure(lambda t: t[lower:upper], part)
                for part in (x, y, sample_weight)]

    loss, states, grads, total = gradients(*micro(0), whole=(rows, sample_weight))
    connected = [i for i, g in enumerate(grads) if g is not None]

    def add_micro_batch(m, loss, states, summed):
        more_loss, more_states, more_grads, _ = gradients(*micro(m), total=total)
        return (m + 1, loss + more_loss, [state + more for state, more in zip(states, more_states)],
                [grad + tf.convert_to_tensor(more_grads[i]) for grad, i in zip(summed, connected)])

    _, loss, states, summed = tf.while_loop(
        lambda m, *_: m < accumulate_steps, add_micro_batch,
        (tf.constant(1), loss, states, [tf.convert_to_tensor(grads[i]) for i in connected]), parallel_iterations=1)
    for i, total_grad in zip(connected, summed):
        grads[i] = total_grad
    return loss, states, grads


def agreed_overflow(grads, loss):
    """(the gradients, NaN on every replica where any replica's are not finite; whether they were not).

    A keras.optimizers.LossScaleOptimizer skips a step with non-finite gradients, but decides from
    one replica's: poisoning every replica's makes them all agree, and skip the same step.
    """
    finite = all_finite([g for g in grads if g is not None] + [loss])
    bad = summed_over_replicas(1.0 - tf.cast(finite, tf.float32)) > 0
    return [None if g is None else tf.where(bad, tf.constant(float("nan"), g.dtype), g) for g in grads], bad


def kept_if_skipped(bad, statistics, before, loss, states):
    """nan_policy=skip: on a skipped step, the statistics put back, and nothing added to the sums."""
    for variable, value in zip(statistics, before):
        variable.assign(tf.where(bad, value, variable))
    return tf.where(bad, 0.0, loss), [tf.where(bad, tf.zeros_like(s), s) for s in states]


def loss_scale_of(optimizer):
    """The optimizer if it is a loss-scale optimizer (its scale_loss scales what is differentiated), else None."""
    return optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None


def finite_check(model):
    """A tf.function telling whether every float weight of the model is finite."""
    weights = [w for w in model.weights if tf.as_dtype(w.dtype).is_floating]
    return tf.function(lambda: all_finite(weights), autograph=False)
