"""The per-replica train step, composed from small named parts, and the evaluation step.

The parts: `loss_gradients` (the forward pass, the loss share of the global batch and its
gradients), `accumulated` (N micro-batches, one all-reduce), `agreed_overflow` (a loss-scale
optimizer's skip, decided alike on every replica), `kept_if_skipped` (nan_policy=skip leaves the
batch-norm statistics and the sums as they were), `update` (the optimizer's apply, where the
all-reduce happens) and `transformed` (a per-replica input transform, such as the MNIST
preset's augmentation). `make_train_function` composes them and runs them K steps per call
(gpupar.training.inner_loop). Another kind of step takes the parts that apply to it.
"""

import keras
import numpy as np
import tensorflow as tf

from gpupar.models.layers import replica_seeds
from gpupar.training.inner_loop import SUM, all_finite, steps_in_one_call, unpack
from gpupar.training.objective import len_rows


def loss_gradients(model, objective, optimizer, regularisation_share: float = 1.0):
    """Part: gradients(x, y, sample_weight, whole=None, total=None) -> (loss share, metric states, gradients, denominators).

    The loss each replica differentiates is its share of the global batch's (gpupar.training.objective:
    `whole` and `total` give a micro-batch the whole batch's denominators) plus its share of the
    model's regularisation losses, times `regularisation_share` (1/N for N micro-batches, so that
    they add the penalties once). Keras' random layers draw apart on each replica
    (gpupar.models.layers.replica_seeds). A loss-scale optimizer scales the differentiated loss.
    """
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def gradients(x, y, sample_weight, whole=None, total=None):
        with tf.GradientTape() as tape:
            with replica_seeds():
                y_pred = model(x, training=True)
            y_pred = tf.nest.map_structure(lambda t: tf.cast(t, tf.float32), y_pred)  # 16-bit under mixed precision
            loss, total = objective.replica_loss(y, y_pred, sample_weight, whole, total)
            if model.losses:  # weight penalties: each replica adds its share, the replicas' sum adds them once
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses)) * regularisation_share
            differentiated = optimizer.scale_loss(loss) if scaled else loss
        grads = tape.gradient(differentiated, model.trainable_variables)
        return loss, objective.metric_states(y, y_pred, sample_weight), grads, total

    return gradients


def accumulated(gradients, accumulate_steps: int):
    """Part: batch_gradients(x, y, sample_weight) -> (loss share, metric states, gradients) of accumulate_steps micro-batches.

    Each replica splits its share of the batch into N micro-batches, runs forward and backward on
    them one after another (one holds its activations at a time) and adds up their gradients.
    The first micro-batch gives the whole global batch's loss denominators and the others divide
    by them too, so the sum is the gradient of one step on the whole batch (exactly so for a
    model without batch norm, which normalises each micro-batch on its own).
    """

    def batch_gradients(x, y, sample_weight):
        rows = len_rows(x)

        def micro(m):
            lower, upper = (m * rows) // accumulate_steps, ((m + 1) * rows) // accumulate_steps
            return [None if part is None else tf.nest.map_structure(lambda t: t[lower:upper], part)
                    for part in (x, y, sample_weight)]

        loss, states, grads, total = gradients(*micro(0), whole=(rows, sample_weight))
        connected = [i for i, g in enumerate(grads) if g is not None]

        def add_micro_batch(m, loss, states, summed):
            more_loss, more_states, more_grads, _ = gradients(*micro(m), total=total)
            return (m + 1, loss + more_loss, [total + more for total, more in zip(states, more_states)],
                    [total + tf.convert_to_tensor(more_grads[i]) for total, i in zip(summed, connected)])

        _, loss, states, summed = tf.while_loop(
            lambda m, *_: m < accumulate_steps, add_micro_batch,
            (tf.constant(1), loss, states, [tf.convert_to_tensor(grads[i]) for i in connected]), parallel_iterations=1)
        for i, total_grad in zip(connected, summed):
            grads[i] = total_grad
        return loss, states, grads

    if accumulate_steps == 1:
        return lambda x, y, sample_weight: gradients(x, y, sample_weight)[:3]
    return batch_gradients


def agreed_overflow(grads, loss):
    """Part: (the gradients, NaN on every replica where any replica's are not finite; whether they were not).

    A keras.optimizers.LossScaleOptimizer skips a step with non-finite gradients, but decides from
    one replica's: poisoning every replica's makes them all agree, and skip the same step.
    """
    finite = all_finite([g for g in grads if g is not None] + [loss])
    bad = tf.distribute.get_replica_context().all_reduce(SUM, 1.0 - tf.cast(finite, tf.float32)) > 0
    return [None if g is None else tf.where(bad, tf.constant(float("nan"), g.dtype), g) for g in grads], bad


def kept_if_skipped(bad, statistics, before, loss, states):
    """Part (nan_policy=skip): on a skipped step, the statistics put back, and nothing added to the sums."""
    for variable, value in zip(statistics, before):
        variable.assign(tf.where(bad, value, variable))
    return tf.where(bad, 0.0, loss), [tf.where(bad, tf.zeros_like(s), s) for s in states]


def update(batch_gradients, model, optimizer, skip_nonfinite: bool = False):
    """Part: update(x, y, sample_weight) -> (loss share, metric states): the gradients applied.

    The all-reduce happens in the optimizer's apply: Keras 3's optimizer sums the gradients of all
    replicas (one ReplicaContext.all_reduce(SUM) over the whole list, through the strategy's
    cross-device ops) and then applies one identical update on every replica. Reducing them here
    as well would make every update num_replicas times too large. With a loss-scale optimizer a
    step whose gradients overflow on any replica is skipped on all (agreed_overflow); with
    skip_nonfinite such a step also leaves the batch-norm statistics and the sums as they were.
    """
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def apply_update(x, y, sample_weight):
        statistics = [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating]
        before = [tf.identity(v) for v in statistics] if skip_nonfinite else []
        loss, states, grads = batch_gradients(x, y, sample_weight)
        rows = tf.cast(len_rows(x), tf.float32)  # this replica's share of the batch
        # The epoch's loss weighs each step's by its examples, as Keras' does (a last partial batch):
        # the replicas' shares times the whole batch's examples add up to its mean times them.
        weighted, kept = loss * tf.distribute.get_replica_context().all_reduce(SUM, rows), rows
        if scaled:
            grads, bad = agreed_overflow(grads, loss)
            if skip_nonfinite:
                weighted, states = kept_if_skipped(bad, statistics, before, weighted, states)
                kept = tf.where(bad, 0.0, kept)
        optimizer.apply(grads, model.trainable_variables)
        return weighted, kept, rows, states

    return apply_update


def transformed(step, device_transform, step_counter):
    """Part: step(x, y, sample_weight) on inputs transformed by device_transform(x, step_counter), on each replica."""
    if device_transform is None:
        return step
    return lambda x, y, sample_weight: step(device_transform(x, step_counter), y, sample_weight)


def make_train_function(strategy, model, optimizer, objective, skip_nonfinite: bool = False, device_transform=None,
                        jit_compile: bool = False, accumulate_steps: int = 1, parallel_iterations: int = 1):
    """Returns train(iterator, num_steps, skip_first_wait) -> ((loss sum, metric states), input wait s, step s).

    It runs num_steps synchronous steps inside one tf.function call (steps_in_one_call); the sums
    are over replicas and steps. The step is the parts above: the loss and its gradients, over
    accumulate_steps micro-batches, applied with the loss scale's and the NaN policy's skips.
    With jit_compile each replica's step (forward, backward, update) is one XLA computation; a
    device_transform runs before it, outside XLA (it has no CPU kernel for the image warp).
    parallel_iterations: see gpupar.training.inner_loop.timed_loop_iterations.
    """
    gradients = loss_gradients(model, objective, optimizer, regularisation_share=1.0 / accumulate_steps)
    step = update(accumulated(gradients, accumulate_steps), model, optimizer, skip_nonfinite)
    step = transformed(tf.function(step, jit_compile=True) if jit_compile else step, device_transform,
                       optimizer.iterations)
    return steps_in_one_call(lambda batch: step(*unpack(batch)), (0.0, 0.0, 0.0, objective.zero_states()),
                             timed=True, strategy=strategy, parallel_iterations=parallel_iterations)


def make_evaluate_function(strategy, model, objective):
    """Returns evaluate(iterator, num_steps) -> (loss numerators, loss denominators, metric states), summed."""

    def replica_step(batch):
        x, y, sample_weight = unpack(batch)
        y_pred = tf.nest.map_structure(lambda t: tf.cast(t, tf.float32), model(x, training=False))
        numerators, denominators = objective.terms(y, y_pred, sample_weight)
        return numerators, denominators, objective.metric_states(y, y_pred, sample_weight)

    terms = np.zeros(len(objective.losses), np.float32)
    return steps_in_one_call(replica_step, (terms, terms, objective.zero_states()), strategy=strategy)


def make_evaluation(evaluate, iterator, num_steps: int, objective, model):
    """Returns evaluation() -> {"val_loss": ..., "val_<metric>": ...} over num_steps batches of `iterator`.

    The loss is each output's weighted sum over the whole set divided by its whole denominator,
    plus the model's regularisation losses, as Keras' evaluate reports it.
    """

    def evaluation():
        numerators, denominators, states = evaluate(iterator, tf.constant(num_steps))
        loss = float(np.sum(np.divide(numerators.numpy(), np.maximum(denominators.numpy(), 1e-30))))
        if model.losses:
            loss += float(tf.add_n(model.losses))
        logs = {"val_loss": loss}
        logs.update({f"val_{name}": value for name, value in objective.results([s.numpy() for s in states]).items()})
        return logs

    return evaluation


def make_finite_check(model):
    """Returns a tf.function telling whether every float weight of the model is finite."""
    weights = [w for w in model.weights if tf.as_dtype(w.dtype).is_floating]

    return tf.function(lambda: all_finite(weights))
