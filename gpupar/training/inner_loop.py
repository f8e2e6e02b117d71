"""The inner loop: the call that runs K steps of any kind of step inside one tf.function, and what it returns.

Every kind of step (gpupar.training.steps), training and evaluation, in every mode, runs
through one InnerLoop: the host reads results once per call, never once per step.
"""

import dataclasses
import functools
import logging
from typing import Mapping, Optional

import numpy as np
import tensorflow as tf

from gpupar.training.loss import len_rows


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
    """How many steps of a training call may be under way at once (InnerLoop's parallel_iterations).

    One on CPUs: a step that starts before the one before it has finished would count that
    step's remaining work as waiting for input (the CPU threads are shared). TensorFlow's
    default, 10, on GPUs, where a step's ops only queue kernels on the devices: the next step's
    batch and launches need not wait until every op of this one has been issued.
    """
    return 10 if on_gpus else 1


class InnerLoop:
    """The one call that runs K steps of any kind of step inside one tf.function, for every mode.

    `call(iterator, num_steps, skip_first_wait=False)` runs batch_step on num_steps batches and
    returns (totals, waited s, busy s). batch_step(batch, states) returns (a structure of float32
    tensors shaped like `zeros`, the new states); the former come back summed over the steps.
    With a `strategy`, batch_step is a replica's step: it runs on every replica (strategy.run),
    each replica keeps its own sums on its device through the call, and the sums are reduced
    over the replicas once, when the call ends: no step waits for another's numbers to reach the
    host. combine(totals, values) and reductions (a ReduceOp for each part of `zeros`) replace
    the sums, over steps and over replicas, where a step's results are not sums (a model's own
    train_step: its last logs, averaged over the replicas).

    Every call is timed the same way, from in-graph timestamps: `waited` is the seconds spent
    waiting for input batches (a step's wait is the mean over replicas of the time until the
    replica has its share of the batch: how long a device sits idle for input), `busy` the rest
    of the call's time (forward, backward, update). skip_first_wait leaves out the wait for the
    first batch (a fresh pipeline filling up). On a GPU the timestamps are host-side: the call
    ends when its sums have reached the host. parallel_iterations: steps under way at once
    (timed_loop_iterations for training; TensorFlow's default, 10, where nothing reads the wait).

    state_variables (Keras variables: the compiled metrics') are read when the call starts; each
    replica carries their values through its steps as `states` and updates them as Keras would
    (gpupar.training.steps.parts.updated_metrics), and when the call ends every variable takes the
    replicas' states as it declares its aggregation (carried_into). With `eager` the call runs
    eagerly, not as a tf.function (Keras' run_eagerly).

    With `jit_compile` each replica's step is one XLA computation. The loop hands the step
    batches whose first dimension is unknown (an epoch may end in a smaller one); traced on such
    a batch, XLA compiled the step again for every batch, taking the tensors' values as
    compile-time constants (the ConvNet on one CPU: 10 steps took 185 s against 3.4 s with the
    batch's shape known). So with `full_rows` (the rows of a replica's full batch) a full batch
    is given its static shape and runs the compiled step, and a smaller one (an epoch's last) runs
    the same step without XLA; full_rows None (replicas get unequal shares): every batch goes to
    the compiled step as it is.
    """

    def __init__(self, batch_step, zeros, strategy=None, parallel_iterations: int = 10, combine=None,
                 reductions=None, state_variables=(), eager: bool = False, jit_compile: bool = False,
                 full_rows: Optional[int] = None):
        self.batch_step, self.zeros, self.strategy = batch_step, zeros, strategy
        self.parallel_iterations, self.combine = parallel_iterations, combine or _add
        self.reductions = reductions if reductions is not None else tf.nest.map_structure(lambda _: SUM, zeros)
        self.state_variables, self.full_rows = list(state_variables), full_rows
        self.compiled = tf.function(batch_step, jit_compile=True, autograph=False) if jit_compile else None
        # No autograph (as Keras' own train function): the loop is written as tf.while_loop, and
        # converting gpupar's step code with autograph cost each fresh process seconds of tracing.
        self.call = self.steps_in_one_call if eager else tf.function(self.steps_in_one_call, autograph=False)

    def steps_in_one_call(self, iterator, num_steps, skip_first_wait=False):
        """(totals, waited s, busy s) of num_steps steps on batches from `iterator`."""
        began = tf.timestamp()
        begun = [tf.identity(v.value) for v in self.state_variables]  # read across the replicas, as Keras declares
        first = self.strategy.run(self._fresh, args=(begun,)) if self.strategy is not None else self._fresh(begun)
        # On CPUs one iteration at a time (timed_loop_iterations), so a step asks for its batch once
        # the one before it has finished, update included: the while loop would otherwise start the
        # next iteration's ops early, and the rest of a step on another replica would count as waiting.
        _, carried, waited = tf.while_loop(lambda i, *_: i < num_steps,
                                           functools.partial(self._step, iterator, skip_first_wait),
                                           (tf.constant(0), first, tf.constant(0.0, tf.float64)),
                                           parallel_iterations=self.parallel_iterations)
        totals, states = carried
        carried_into(self.state_variables, begun, states, self.strategy)
        if self.strategy is not None:
            totals = tf.nest.map_structure(lambda op, value: self.strategy.reduce(op, value, axis=None),
                                           self.reductions, totals)
        with tf.device("/cpu:0"):
            on_host = [tf.identity(t) for t in tf.nest.flatten(totals)]
        with tf.control_dependencies([*on_host, waited]):
            ended = tf.timestamp()
        return totals, waited, ended - began - waited

    def _step(self, iterator, skip_first_wait, i, carried, waited):
        """One iteration of the loop: the next batch, its wait, the step on every replica."""
        with tf.control_dependencies([waited]):
            asked = tf.timestamp()
        with tf.control_dependencies([asked]):
            batch = next(iterator)
        arrived = _mean_arrival(batch)
        if self.strategy is None:
            carried = self._replica_step(carried, batch)
        else:
            carried = self.strategy.run(self._replica_step, args=(carried, batch))
        counted = tf.logical_not(tf.logical_and(skip_first_wait, tf.equal(i, 0)))
        return i + 1, carried, waited + tf.where(counted, arrived - asked, tf.constant(0.0, tf.float64))

    def _replica_step(self, carried, batch):
        """One replica's step: its sums and states carried on, the step compiled by XLA where asked."""
        totals, states = carried
        if self.compiled is None:
            values, states = self.batch_step(batch, states)
        elif self.full_rows is None:
            values, states = self.compiled(batch, states)
        else:
            values, states = tf.cond(tf.equal(len_rows(batch), self.full_rows),
                                     lambda: self.compiled(_with_rows(batch, self.full_rows), states),
                                     lambda: self.batch_step(batch, states))
        # A metric's update may lose its state's static shape (Keras 3.10's F1Score): the loop keeps it.
        return self.combine(totals, values), [tf.reshape(s, v.shape) for s, v in zip(states, self.state_variables)]

    def _fresh(self, begun):
        """A replica's sums at zero and its states as the call began."""
        return (tf.nest.map_structure(lambda z: tf.zeros(np.shape(z), tf.float32), self.zeros),
                [tf.identity(value) for value in begun])


def _with_rows(batch, rows: int):
    """The batch with its first dimension said to be `rows` (the branch runs only on such a batch: not checked again)."""
    def static(t):
        if not isinstance(t, tf.Tensor):
            return t
        known = tf.identity(t)
        known.set_shape([rows, *t.shape[1:]])
        return known

    return tf.nest.map_structure(static, batch)


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
