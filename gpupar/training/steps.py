"""The inner loop: per-replica step functions, and the K-steps call that runs them in one tf.function.

The synchronous data-parallel steps live here; the pipeline's and the parameter-server worker's
steps are in gpupar.training.pipeline and gpupar.training.parameter_server, and run through the
same `steps_in_one_call`.
"""

import dataclasses
from typing import Mapping, Optional

import keras
import tensorflow as tf

from gpupar.data import augment

SUM = tf.distribute.ReduceOp.SUM


@dataclasses.dataclass
class Results:
    """Sums over the steps one call finished, on the host.

    Attributes:
      steps: Steps finished.
      loss: Sum of their mean losses (0 for a step skipped as non-finite).
      correct: Correct predictions in them.
      waited: Seconds the devices waited for input batches; None where not timed.
      busy: Seconds of the steps themselves; None where not timed.
      by_worker: Steps finished by each worker (parameter servers), else empty.
    """

    steps: int = 0
    loss: float = 0.0
    correct: float = 0.0
    waited: Optional[float] = None
    busy: Optional[float] = None
    by_worker: Mapping[int, int] = dataclasses.field(default_factory=dict)

    def __add__(self, other: "Results") -> "Results":
        def plus(a, b):
            return b if a is None else a if b is None else a + b

        workers = dict(self.by_worker)
        for worker, steps in other.by_worker.items():
            workers[worker] = workers.get(worker, 0) + steps
        return Results(self.steps + other.steps, self.loss + other.loss, self.correct + other.correct,
                       plus(self.waited, other.waited), plus(self.busy, other.busy), workers)


def count_correct(logits, labels):
    """How many of the batch's argmax predictions equal the labels, as a float32 scalar."""
    predictions = tf.argmax(logits, axis=1, output_type=labels.dtype)
    return tf.reduce_sum(tf.cast(tf.equal(predictions, labels), tf.float32))


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


def steps_in_one_call(batch_step, timed=False):
    """A tf.function(iterator, num_steps) that runs batch_step on num_steps batches in one call.

    batch_step(batch) returns two scalars, (loss, correct); they come back summed over the steps.
    With `timed` the function takes a third argument, skip_first_wait (default False), and also
    returns the seconds spent waiting for input batches and the rest of the call's time (the
    steps: forward, backward, update), read from in-graph timestamps so that measuring adds no
    host round trip. A step's wait is the mean over replicas of the time until the replica has
    its share of the batch (how long a device sits idle for input); skip_first_wait leaves out
    the wait for the first batch (a fresh pipeline filling up). On a GPU the timestamps are
    host-side: the call ends when its sums have reached the host.
    """

    @tf.function
    def run(iterator, num_steps):
        loss_sum, correct_sum = tf.constant(0.0), tf.constant(0.0)
        for _ in tf.range(num_steps):
            loss, correct = batch_step(next(iterator))
            loss_sum += loss
            correct_sum += correct
        return loss_sum, correct_sum

    @tf.function
    def timed_run(iterator, num_steps, skip_first_wait=False):
        loss_sum, correct_sum = tf.constant(0.0), tf.constant(0.0)
        began = tf.timestamp()
        waited = tf.constant(0.0, tf.float64)
        for i in tf.range(num_steps):
            # One iteration at a time, so a step asks for its batch once the one before it has
            # finished, update included. The while loop would otherwise start the next iteration's
            # ops early, and the rest of a step on another replica would count as waiting.
            tf.autograph.experimental.set_loop_options(parallel_iterations=1)
            with tf.control_dependencies([waited]):
                asked = tf.timestamp()
            with tf.control_dependencies([asked]):
                batch = next(iterator)
            arrived = _mean_arrival(batch)
            loss, correct = batch_step(batch)
            loss_sum += loss
            correct_sum += correct
            counted = tf.logical_not(tf.logical_and(skip_first_wait, tf.equal(i, 0)))
            waited += tf.where(counted, arrived - asked, tf.constant(0.0, tf.float64))
        with tf.device("/cpu:0"):
            on_host = tf.identity(tf.stack([loss_sum, correct_sum]))
        with tf.control_dependencies([on_host, waited]):
            ended = tf.timestamp()
        return loss_sum, correct_sum, waited, ended - began - waited

    return timed_run if timed else run


def summed_over_replicas(strategy, replica_step):
    """A batch_step for steps_in_one_call: replica_step on every replica, its two scalars summed over them."""

    def batch_step(batch):
        loss, correct = strategy.run(replica_step, args=batch)
        return strategy.reduce(SUM, loss, axis=None), strategy.reduce(SUM, correct, axis=None)

    return batch_step


def make_train_function(strategy, model, optimizer, global_batch: int, skip_nonfinite: bool = False,
                        augment_seed=None, jit_compile: bool = False):
    """Returns train(iterator, num_steps, skip_first_wait) -> (loss sum, correct, input wait s, step s).

    It runs num_steps synchronous steps inside one tf.function call; the sums are over replicas
    and steps, the seconds are from steps_in_one_call. With augment_seed, each replica warps
    its images (gpupar.data.augment) at the start of the step, on its own device. A
    keras.optimizers.LossScaleOptimizer (mixed_float16, or nan_policy=skip) skips a step whose
    gradients are not finite on any replica, on all of them; with skip_nonfinite such a step also
    leaves the batch-norm statistics as they were and adds nothing to the sums. With jit_compile
    each replica's step (forward, backward, update) is one XLA computation.
    """
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def update(images, labels):
        statistics = [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating]
        if skip_nonfinite:
            before = [tf.identity(v) for v in statistics]
        with tf.GradientTape() as tape:
            logits = tf.cast(model(images, training=True), tf.float32)  # a mixed-precision model's are 16-bit
            per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            # Each replica divides by the GLOBAL batch, so summing over replicas gives the mean.
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            if model.losses:  # the LSTM has no weight penalty
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            differentiated = optimizer.scale_loss(loss) if scaled else loss
        grads = tape.gradient(differentiated, model.trainable_variables)
        correct = count_correct(logits, labels)
        if scaled:
            finite = all_finite([*grads, loss])
            bad = tf.distribute.get_replica_context().all_reduce(SUM, 1.0 - tf.cast(finite, tf.float32)) > 0
            # The loss-scale optimizer skips non-finite gradients but decides from one replica's:
            # poison every replica's so they all agree.
            grads = [tf.where(bad, tf.constant(float("nan"), g.dtype), g) for g in grads]
        if skip_nonfinite:
            for variable, value in zip(statistics, before):
                variable.assign(tf.where(bad, value, variable))
            loss, correct = tf.where(bad, 0.0, loss), tf.where(bad, 0.0, correct)
        # The all-reduce happens here: Keras 3's optimizer sums the gradients of all replicas
        # (one ReplicaContext.all_reduce(SUM) over the whole list, through the strategy's
        # cross-device ops) and then applies one identical Adam update on every replica.
        # Reducing them here as well would make every update num_replicas times too large.
        optimizer.apply(grads, model.trainable_variables)
        return loss, correct

    compiled = tf.function(update, jit_compile=True) if jit_compile else update

    def replica_step(images, labels):
        if augment_seed is not None:  # outside XLA: it has no CPU kernel for the image warp
            images = augment.random_affine(images, augment.device_seed(augment_seed, optimizer.iterations))
        return compiled(images, labels)

    return steps_in_one_call(summed_over_replicas(strategy, replica_step), timed=True)


def make_test_function(strategy, model):
    """Returns test(iterator, num_steps) -> (correct predictions, examples seen)."""

    def replica_step(images, labels):
        logits = model(images, training=False)
        return count_correct(logits, labels), tf.cast(tf.shape(labels)[0], tf.float32)

    return steps_in_one_call(summed_over_replicas(strategy, replica_step))


def make_evaluation(test, iterator, num_steps: int):
    """Returns evaluate() -> accuracy over num_steps batches, for a test function of steps_in_one_call."""

    def evaluate():
        correct, count = test(iterator, tf.constant(num_steps))
        return float(correct) / float(count)

    return evaluate


def make_finite_check(model):
    """Returns a tf.function telling whether every float weight of the model is finite."""
    weights = [w for w in model.weights if tf.as_dtype(w.dtype).is_floating]

    return tf.function(lambda: all_finite(weights))
