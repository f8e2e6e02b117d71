"""The inner loop: the call that runs K steps of any kind of step inside one tf.function, and what it returns.

Every kind of step (gpupar.training.steps) runs through `steps_in_one_call`: the host reads
results once per call, never once per step.
"""

import dataclasses
import logging
from typing import Mapping, Optional

import numpy as np
import tensorflow as tf


SUM = tf.distribute.ReduceOp.SUM


class _RetracingNotes(logging.Filter):
    """Drops TensorFlow's "triggered tf.function retracing" warning about the K-steps calls.

    Every run makes its calls anew (its model and strategy are its own), so a process with many
    fits (a notebook, a search, a test session) makes them many times: the warning's own reason
    (1), which is no fault here.
    """

    def filter(self, record):
        message = record.getMessage()
        return not ("retracing" in message and ("steps_in_one_call" in message or "finite_check" in message))


logging.getLogger("tensorflow").addFilter(_RetracingNotes())


@dataclasses.dataclass
class Results:
    """Sums over the steps one call finished, on the host.

    Attributes:
      steps: Steps finished.
      loss: Sum over the steps of each one's loss (the mean over its global batch) times its
        examples (0 for a step skipped as non-finite): what the loop checks is finite.
      examples: Examples of those steps, skipped ones included.
      waited: Seconds the devices waited for input batches; None where not timed.
      busy: Seconds of the steps themselves; None where not timed.
      by_worker: Steps finished by each worker (parameter servers), else empty.
      step_logs: What a model's own train_step returned at the last of these steps, else None.
    """

    steps: int = 0
    loss: float = 0.0
    examples: float = 0.0
    waited: Optional[float] = None
    busy: Optional[float] = None
    by_worker: Mapping[int, int] = dataclasses.field(default_factory=dict)
    step_logs: Optional[Mapping[str, float]] = None

    def __add__(self, other: "Results") -> "Results":
        def plus(mine, theirs):
            return theirs if mine is None else mine if theirs is None else mine + theirs

        workers = dict(self.by_worker)
        for worker, steps in other.by_worker.items():
            workers[worker] = workers.get(worker, 0) + steps
        return Results(self.steps + other.steps, self.loss + other.loss, self.examples + other.examples,
                       plus(self.waited, other.waited), plus(self.busy, other.busy), workers,
                       other.step_logs if other.step_logs is not None else self.step_logs)


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


def steps_in_one_call(batch_step, zeros, timed=False, strategy=None, parallel_iterations=1, combine=None,
                      reductions=None, state_variables=(), eager=False):
    """A tf.function(iterator, num_steps) that runs batch_step on num_steps batches in one call.

    batch_step(batch, states) returns (a structure of float32 tensors shaped like `zeros`, the new
    states); the former come back summed over the steps. With a `strategy`, batch_step is a
    replica's step: it runs on every replica (strategy.run), each replica keeps its own sums on its
    device through the call, and the sums are reduced over the replicas once, when the call ends:
    no step waits for another's numbers to reach the host. With `timed` the function takes a third
    argument, skip_first_wait (default False), and also returns the seconds spent waiting for
    input batches and the rest of the call's time (the steps: forward, backward, update), read from
    in-graph timestamps. A step's wait is the mean over replicas of the time until the replica has
    its share of the batch (how long a device sits idle for input); skip_first_wait leaves out the
    wait for the first batch (a fresh pipeline filling up). On a GPU the timestamps are host-side:
    the call ends when its sums have reached the host. parallel_iterations: steps of the timed loop
    under way at once (timed_loop_iterations). combine(totals, values) and reductions (a ReduceOp
    for each part of `zeros`) replace the sums, over steps and over replicas, where a step's
    results are not sums (a model's own train_step: its last logs, averaged over the replicas).

    state_variables (Keras variables: the compiled metrics') are read when the call starts; each
    replica carries their values through its steps as `states` and updates them as Keras would
    (gpupar.training.steps.parts.updated_metrics), and when the call ends every variable takes the
    replicas' states as it declares its aggregation (carried_into). With `eager` the function runs
    eagerly, not as a tf.function (Keras' run_eagerly).
    """
    function = (lambda f: f) if eager else tf.function(autograph=False)
    combine = combine or _add
    state_variables = list(state_variables)

    def start():
        begun = [tf.identity(v.value) for v in state_variables]  # read across the replicas, as Keras declares
        fresh = lambda: (tf.nest.map_structure(lambda z: tf.zeros(np.shape(z), tf.float32), zeros),  # noqa: E731
                         [tf.identity(value) for value in begun])
        return (strategy.run(fresh) if strategy is not None else fresh()), begun

    def replica_step(carried, batch):
        totals, states = carried
        values, states = batch_step(batch, states)
        # A metric's update may lose its state's static shape (Keras 3.10's F1Score): the loop keeps it.
        return combine(totals, values), [tf.reshape(s, v.shape) for s, v in zip(states, state_variables)]

    def step(carried, batch):
        if strategy is None:
            return replica_step(carried, batch)
        return strategy.run(replica_step, args=(carried, batch))

    def reduced(carried, begun):
        totals, states = carried
        carried_into(state_variables, begun, states, strategy)
        if strategy is None:
            return totals
        ops = reductions if reductions is not None else tf.nest.map_structure(lambda _: SUM, zeros)
        return tf.nest.map_structure(lambda op, value: strategy.reduce(op, value, axis=None), ops, totals)

    # No autograph (as Keras' own train function): the loops are written as tf.while_loop, and
    # converting gpupar's step code with autograph cost each fresh process seconds of tracing.
    @function
    def run(iterator, num_steps):
        def body(i, carried):
            return i + 1, step(carried, next(iterator))

        first, begun = start()
        _, carried = tf.while_loop(lambda i, _: i < num_steps, body, (tf.constant(0), first))
        return reduced(carried, begun)

    @function
    def timed_run(iterator, num_steps, skip_first_wait=False):
        def body(i, carried, waited):
            # On CPUs one iteration at a time, so a step asks for its batch once the one before it
            # has finished, update included: the while loop would otherwise start the next
            # iteration's ops early, and the rest of a step on another replica would count as
            # waiting. On GPUs the iterations may overlap (timed_loop_iterations).
            with tf.control_dependencies([waited]):
                asked = tf.timestamp()
            with tf.control_dependencies([asked]):
                batch = next(iterator)
            arrived = _mean_arrival(batch)
            carried = step(carried, batch)
            counted = tf.logical_not(tf.logical_and(skip_first_wait, tf.equal(i, 0)))
            return i + 1, carried, waited + tf.where(counted, arrived - asked, tf.constant(0.0, tf.float64))

        began = tf.timestamp()
        first, begun = start()
        _, carried, waited = tf.while_loop(lambda i, *_: i < num_steps, body,
                                           (tf.constant(0), first, tf.constant(0.0, tf.float64)),
                                           parallel_iterations=parallel_iterations)
        totals = reduced(carried, begun)
        with tf.device("/cpu:0"):
            on_host = [tf.identity(t) for t in tf.nest.flatten(totals)]
        with tf.control_dependencies([*on_host, waited]):
            ended = tf.timestamp()
        return totals, waited, ended - began - waited

    return timed_run if timed else run


def carried_into(variables, begun, states, strategy=None):
    """Gives each Keras variable the replicas' final states, as the variable declares its aggregation.

    "sum" (every Keras metric's totals and counts): the replicas' changes from `begun` are added
    to the variable, by TensorFlow's own assign_add (Keras' is a read and a write, which a
    variable summed on write over the replicas, as Keras 3.8's metrics or CentralStorageStrategy's,
    would add again), or, where its replicas' values are summed when read (Keras 3.10 and
    later), held whole by the first replica (an integer count split over replicas would round);
    "mean": their mean; otherwise the first replica's.
    """
    if not variables:
        return
    if strategy is not None:
        changes = strategy.run(lambda states: [s - b for s, b in zip(states, begun)], args=(states,))
    else:
        changes = [s - b for s, b in zip(states, begun)]
    for index, variable in enumerate(variables):
        aggregation = str(variable.aggregation).lower()
        if strategy is None:
            variable.value.assign_add(tf.cast(changes[index], variable.dtype))
        elif "sum" in aggregation:
            change = tf.cast(strategy.reduce(SUM, changes[index], axis=None), variable.dtype)
            if _on_read(variable):  # its replicas' values are summed when read: the first holds it all, exactly
                total = begun[index] + change
                strategy.run(lambda v=variable, t=total: v.assign(tf.where(
                    tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0), t, tf.zeros_like(t))))
            else:
                variable.value.assign_add(change)
        elif "mean" in aggregation:
            variable.assign(strategy.reduce(tf.distribute.ReduceOp.MEAN, states[index], axis=None))
        else:
            variable.assign(strategy.experimental_local_results(states[index])[0])


def _on_read(variable) -> bool:
    """Whether a Keras variable keeps a value per replica, combined when read (tf.distribute's sync on read)."""
    value = variable.value
    return isinstance(value, tf.distribute.DistributedValues) and value.synchronization == \
        tf.VariableSynchronization.ON_READ


def unpack(batch):
    """(x, y or None, sample_weight or None) of a batch of x, (x,), (x, y) or (x, y, sample_weight), as Keras unpacks it."""
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple):
        return batch, None, None
    return tuple(batch) + (None,) * (3 - len(batch))
