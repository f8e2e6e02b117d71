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
        examples, as Keras' epoch loss weighs them (0 for a step skipped as non-finite).
      kept_examples: Examples of those steps, skipped ones left out.
      examples: Examples of those steps, skipped ones included.
      states: The metrics' states summed over the steps (gpupar.training.objective), flattened.
      waited: Seconds the devices waited for input batches; None where not timed.
      busy: Seconds of the steps themselves; None where not timed.
      by_worker: Steps finished by each worker (parameter servers), else empty.
      step_logs: What a model's own train_step returned at the last of these steps, else None.
    """

    steps: int = 0
    loss: float = 0.0
    kept_examples: float = 0.0
    examples: float = 0.0
    states: list = dataclasses.field(default_factory=list)
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
        states = [mine + theirs for mine, theirs in zip(self.states, other.states)] if self.states and other.states else (
            self.states or other.states)
        return Results(self.steps + other.steps, self.loss + other.loss, self.kept_examples + other.kept_examples,
                       self.examples + other.examples, states, plus(self.waited, other.waited),
                       plus(self.busy, other.busy), workers,
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
                      reductions=None):
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
    (timed_loop_iterations). combine(totals, values) and reductions (a ReduceOp for each part of
    `zeros`) replace the sums, over steps and over replicas, where a step's results are not sums
    (a model's own train_step: its last logs, averaged over the replicas).
    """
    combine = combine or _add

    def start():
        fresh = lambda: tf.nest.map_structure(lambda z: tf.zeros(np.shape(z), tf.float32), zeros)  # noqa: E731
        return strategy.run(fresh) if strategy is not None else fresh()

    def step(totals, batch):
        if strategy is None:
            return combine(totals, batch_step(batch))
        return strategy.run(lambda replica_totals, share: combine(replica_totals, batch_step(share)), args=(totals, batch))

    def reduced(totals):
        if strategy is None:
            return totals
        ops = reductions if reductions is not None else tf.nest.map_structure(lambda _: SUM, zeros)
        return tf.nest.map_structure(lambda op, value: strategy.reduce(op, value, axis=None), ops, totals)

    # No autograph (as Keras' own train function): the loops are written as tf.while_loop, and
    # converting gpupar's step code with autograph cost each fresh process seconds of tracing.
    @tf.function(autograph=False)
    def run(iterator, num_steps):
        def body(i, totals):
            return i + 1, step(totals, next(iterator))

        _, totals = tf.while_loop(lambda i, _: i < num_steps, body, (tf.constant(0), start()))
        return reduced(totals)

    @tf.function(autograph=False)
    def timed_run(iterator, num_steps, skip_first_wait=False):
        def body(i, totals, waited):
            # On CPUs one iteration at a time, so a step asks for its batch once the one before it
            # has finished, update included: the while loop would otherwise start the next
            # iteration's ops early, and the rest of a step on another replica would count as
            # waiting. On GPUs the iterations may overlap (timed_loop_iterations).
            with tf.control_dependencies([waited]):
                asked = tf.timestamp()
            with tf.control_dependencies([asked]):
                batch = next(iterator)
            arrived = _mean_arrival(batch)
            totals = step(totals, batch)
            counted = tf.logical_not(tf.logical_and(skip_first_wait, tf.equal(i, 0)))
            return i + 1, totals, waited + tf.where(counted, arrived - asked, tf.constant(0.0, tf.float64))

        began = tf.timestamp()
        _, totals, waited = tf.while_loop(lambda i, *_: i < num_steps, body,
                                          (tf.constant(0), start(), tf.constant(0.0, tf.float64)),
                                          parallel_iterations=parallel_iterations)
        totals = reduced(totals)
        with tf.device("/cpu:0"):
            on_host = [tf.identity(t) for t in tf.nest.flatten(totals)]
        with tf.control_dependencies([*on_host, waited]):
            ended = tf.timestamp()
        return totals, waited, ended - began - waited

    return timed_run if timed else run


def weighed(loss, rows):
    """(loss x rows, rows, rows) of a step: what its call sums for the epoch's loss and its examples."""
    rows = tf.cast(rows, tf.float32)
    return loss * rows, rows, rows


def unpack(batch):
    """(x, y or None, sample_weight or None) of a batch of x, (x,), (x, y) or (x, y, sample_weight), as Keras unpacks it."""
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple):
        return batch, None, None
    return tuple(batch) + (None,) * (3 - len(batch))
