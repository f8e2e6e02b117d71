"""The inner loop: per-replica step functions, and the K-steps call that runs them in one tf.function.

The synchronous data-parallel steps live here; the pipeline's and the parameter-server worker's
steps are in gpupar.training.pipeline and gpupar.training.parameter_server, and run through the
same `steps_in_one_call`.
"""

import dataclasses
from typing import Mapping, Optional

import keras
import numpy as np
import tensorflow as tf

from gpupar.models.layers import replica_seeds
from gpupar.training.objective import len_rows

SUM = tf.distribute.ReduceOp.SUM


@dataclasses.dataclass
class Results:
    """Sums over the steps one call finished, on the host.

    Attributes:
      steps: Steps finished.
      loss: Sum of their losses, each the mean over its global batch (0 for a step skipped as non-finite).
      states: The metrics' states summed over the steps (gpupar.training.objective), flattened.
      waited: Seconds the devices waited for input batches; None where not timed.
      busy: Seconds of the steps themselves; None where not timed.
      by_worker: Steps finished by each worker (parameter servers), else empty.
    """

    steps: int = 0
    loss: float = 0.0
    states: list = dataclasses.field(default_factory=list)
    waited: Optional[float] = None
    busy: Optional[float] = None
    by_worker: Mapping[int, int] = dataclasses.field(default_factory=dict)

    def __add__(self, other: "Results") -> "Results":
        def plus(mine, theirs):
            return theirs if mine is None else mine if theirs is None else mine + theirs

        workers = dict(self.by_worker)
        for worker, steps in other.by_worker.items():
            workers[worker] = workers.get(worker, 0) + steps
        states = [mine + theirs for mine, theirs in zip(self.states, other.states)] if self.states and other.states else (
            self.states or other.states)
        return Results(self.steps + other.steps, self.loss + other.loss, states,
                       plus(self.waited, other.waited), plus(self.busy, other.busy), workers)


def all_finite(tensors):
    """A scalar bool: no NaN or Inf in any of the tensors."""
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])


def _mean_arrival(batch):
    """The mean over replicas of a timestamp taken when all of that replica's share of `batch` exists."""
    # A distributed batch's leaves are PerReplica values; flattened, they list one tensor per replica.
    leaves = [tf.nest.flatten(leaf, expand_composites=True) for leaf in tf.nest.flatten(batch)]
    stamps = []
    for share in zip(*leaves):
        with tf.control_dependencies(list(share)):
            stamps.append(tf.timestamp())
    return tf.reduce_mean(tf.stack(stamps))


def _add(totals, values):
    return tf.nest.map_structure(tf.add, totals, values)


def timed_loop_iterations(on_gpus: bool) -> int:
    """How many steps the timed loop of steps_in_one_call may have under way at once.

    One on CPUs: a step that starts before the one before it has finished would count that
    step's remaining work as waiting for input (the CPU threads are shared). TensorFlow's
    default, 10, on GPUs, where a step's ops only queue kernels on the devices: the next step's
    batch and launches need not wait until every op of this one has been issued, as with the
    untimed loop.
    """
    return 10 if on_gpus else 1


def steps_in_one_call(batch_step, zeros, timed=False, strategy=None, parallel_iterations=1):
    """A tf.function(iterator, num_steps) that runs batch_step on num_steps batches in one call.

    batch_step(batch) returns a structure of float32 tensors shaped like `zeros`; they come back
    summed over the steps. With a `strategy`, batch_step is a replica's step: it runs on every
    replica (strategy.run), each replica keeps its own sums on its device through the call, and
    the sums are reduced over the replicas once, when the call ends: no step waits for another's
    numbers to reach the host. With `timed` the function takes a third argument, skip_first_wait
    (default False), and also returns the seconds spent waiting for input batches and the rest of
    the call's time (the steps: forward, backward, update), read from in-graph timestamps. A step's
    wait is the mean over replicas of the time until the replica has its share of the batch (how
    long a device sits idle for input); skip_first_wait leaves out the wait for the first batch (a
    fresh pipeline filling up). On a GPU the timestamps are host-side: the call ends when its sums
    have reached the host. parallel_iterations: steps of the timed loop under way at once
    (timed_loop_iterations).
    """

    def start():
        fresh = lambda: tf.nest.map_structure(lambda z: tf.zeros(np.shape(z), tf.float32), zeros)  # noqa: E731
        return strategy.run(fresh) if strategy is not None else fresh()

    def step(totals, batch):
        if strategy is None:
            return _add(totals, batch_step(batch))
        return strategy.run(lambda replica_totals, share: _add(replica_totals, batch_step(share)), args=(totals, batch))

    def reduced(totals):
        if strategy is None:
            return totals
        return tf.nest.map_structure(lambda value: strategy.reduce(SUM, value, axis=None), totals)

    @tf.function
    def run(iterator, num_steps):
        totals = start()
        for _ in tf.range(num_steps):
            totals = step(totals, next(iterator))
        return reduced(totals)

    @tf.function
    def timed_run(iterator, num_steps, skip_first_wait=False):
        totals = start()
        began = tf.timestamp()
        waited = tf.constant(0.0, tf.float64)
        for i in tf.range(num_steps):
            # On CPUs one iteration at a time, so a step asks for its batch once the one before it
            # has finished, update included: the while loop would otherwise start the next
            # iteration's ops early, and the rest of a step on another replica would count as
            # waiting. On GPUs the iterations may overlap (timed_loop_iterations).
            tf.autograph.experimental.set_loop_options(parallel_iterations=parallel_iterations)
            with tf.control_dependencies([waited]):
                asked = tf.timestamp()
            with tf.control_dependencies([asked]):
                batch = next(iterator)
            arrived = _mean_arrival(batch)
            totals = step(totals, batch)
            counted = tf.logical_not(tf.logical_and(skip_first_wait, tf.equal(i, 0)))
            waited += tf.where(counted, arrived - asked, tf.constant(0.0, tf.float64))
        totals = reduced(totals)
        with tf.device("/cpu:0"):
            on_host = [tf.identity(t) for t in tf.nest.flatten(totals)]
        with tf.control_dependencies([*on_host, waited]):
            ended = tf.timestamp()
        return totals, waited, ended - began - waited

    return timed_run if timed else run


def unpack(batch):
    """(x, y, sample_weight or None) of a batch of (x, y) or (x, y, sample_weight)."""
    return (*batch, None) if len(batch) == 2 else tuple(batch)


def make_train_function(strategy, model, optimizer, objective, skip_nonfinite: bool = False, device_transform=None,
                        jit_compile: bool = False, accumulate_steps: int = 1, parallel_iterations: int = 1):
    """Returns train(iterator, num_steps, skip_first_wait) -> ((loss sum, metric states), input wait s, step s).

    It runs num_steps synchronous steps inside one tf.function call; the sums are over replicas
    and steps, the seconds are from steps_in_one_call. The loss each replica differentiates is
    its share of the global batch's (gpupar.training.objective) plus its share of the model's
    regularisation losses. With device_transform(x, step), each replica transforms its inputs
    (the MNIST preset's augmentation) at the start of the step, on its own device. A
    keras.optimizers.LossScaleOptimizer (mixed_float16, or nan_policy=skip) skips a step whose
    gradients are not finite on any replica, on all of them; with skip_nonfinite such a step also
    leaves the non-trainable state (batch-norm statistics) as it was and adds nothing to the sums.
    With jit_compile each replica's step (forward, backward, update) is one XLA computation. Keras'
    random layers draw apart on each replica (gpupar.models.layers.replica_seeds).

    With accumulate_steps N > 1 each replica splits its share of the batch into N micro-batches,
    runs forward and backward on them one after another and adds up their gradients; then one
    all-reduce and one update. Each micro-batch's loss is divided by the whole global batch's
    denominator, so the update is the one of a single step on the whole batch (exactly so for
    a model without batch norm, which normalises each micro-batch on its own).
    parallel_iterations: see timed_loop_iterations.
    """
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    regularisation_share = 1.0 / accumulate_steps  # the micro-batches add the weight penalties once

    def gradients(x, y, sample_weight, whole=None, total=None):
        """(loss share, metric states, gradients, loss denominators) of one batch or micro-batch."""
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

    def accumulated(x, y, sample_weight):
        """(loss share, metric states, gradients) of the batch as accumulate_steps micro-batches in turn."""
        rows = len_rows(y)

        def micro(m):
            lower, upper = (m * rows) // accumulate_steps, ((m + 1) * rows) // accumulate_steps
            return [None if part is None else tf.nest.map_structure(lambda t: t[lower:upper], part)
                    for part in (x, y, sample_weight)]

        # The first micro-batch gives the whole batch's denominators; the others divide by them too.
        loss, states, grads, total = gradients(*micro(0), whole=(rows, sample_weight))
        connected = [i for i, g in enumerate(grads) if g is not None]

        def add_micro_batch(m, loss, states, summed):
            more_loss, more_states, more_grads, _ = gradients(*micro(m), total=total)
            return (m + 1, loss + more_loss, [total + more for total, more in zip(states, more_states)],
                    [total + tf.convert_to_tensor(more_grads[i]) for total, i in zip(summed, connected)])

        # One micro-batch at a time, so that only one holds its activations in memory.
        _, loss, states, summed = tf.while_loop(
            lambda m, *_: m < accumulate_steps, add_micro_batch,
            (tf.constant(1), loss, states, [tf.convert_to_tensor(grads[i]) for i in connected]), parallel_iterations=1)
        for i, total_grad in zip(connected, summed):
            grads[i] = total_grad
        return loss, states, grads

    def update(x, y, sample_weight):
        statistics = [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating]
        if skip_nonfinite:
            before = [tf.identity(v) for v in statistics]
        if accumulate_steps > 1:
            loss, states, grads = accumulated(x, y, sample_weight)
        else:
            loss, states, grads, _ = gradients(x, y, sample_weight)
        if scaled:
            finite = all_finite([g for g in grads if g is not None] + [loss])
            bad = tf.distribute.get_replica_context().all_reduce(SUM, 1.0 - tf.cast(finite, tf.float32)) > 0
            # The loss-scale optimizer skips non-finite gradients but decides from one replica's:
            # poison every replica's so they all agree.
            grads = [None if g is None else tf.where(bad, tf.constant(float("nan"), g.dtype), g) for g in grads]
        if skip_nonfinite:
            for variable, value in zip(statistics, before):
                variable.assign(tf.where(bad, value, variable))
            loss = tf.where(bad, 0.0, loss)
            states = [tf.where(bad, tf.zeros_like(s), s) for s in states]
        # The all-reduce happens here: Keras 3's optimizer sums the gradients of all replicas
        # (one ReplicaContext.all_reduce(SUM) over the whole list, through the strategy's
        # cross-device ops) and then applies one identical update on every replica.
        # Reducing them here as well would make every update num_replicas times too large.
        optimizer.apply(grads, model.trainable_variables)
        return loss, states

    compiled = tf.function(update, jit_compile=True) if jit_compile else update

    def replica_step(batch):
        x, y, sample_weight = unpack(batch)
        if device_transform is not None:  # outside XLA: it has no CPU kernel for the image warp
            x = device_transform(x, optimizer.iterations)
        return compiled(x, y, sample_weight)

    zeros = (0.0, objective.zero_states())
    return steps_in_one_call(replica_step, zeros, timed=True, strategy=strategy,
                             parallel_iterations=parallel_iterations)


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
