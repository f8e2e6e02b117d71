"""What a kind of step is, and the two ways every kind runs: K train steps per call, and one evaluation.

A Step is what one replica does with one batch: `train(batch)` (forward, loss, gradients,
update, metrics) and `evaluate(batch)`, each returning values that the K-steps call
(gpupar.training.inner_loop.steps_in_one_call) adds up over steps and replicas on the devices,
and that the host reads once per call (`results`, `logs`). Every kind (the compiled model's
step, the model's own train_step, the pipelined stages) runs through `train_function` and
`evaluation` below; a mode decides only where and how often the calls run.
"""

from typing import Optional

import tensorflow as tf

from gpupar.training.inner_loop import SUM, Results, steps_in_one_call


class Step:
    """One kind of step, per replica. Subclasses define train, evaluate and their zeros; the rest has defaults.

    Attributes:
      model: The Keras model the step trains.
      optimizer: The optimizer whose update counter counts the steps (and whose state checkpoints hold).
      jit_compile: Whether each replica's train step is one XLA computation.
    """

    jit_compile = False

    def train_zeros(self):
        """Zeros shaped like what train() returns."""
        raise NotImplementedError

    def train(self, batch):
        """One replica's train step on its share of the batch; returns values shaped like train_zeros()."""
        raise NotImplementedError

    def eval_zeros(self):
        """Zeros shaped like what evaluate() returns."""
        raise NotImplementedError

    def evaluate(self, batch):
        """One replica's evaluation of its share of the batch; returns values shaped like eval_zeros()."""
        raise NotImplementedError

    def combine(self, totals, values):
        """The totals after one more step's values: their sum, unless the kind says otherwise."""
        return tf.nest.map_structure(tf.add, totals, values)

    def reductions(self, zeros):
        """How the totals combine over replicas: a ReduceOp for each part of `zeros` (SUM by default)."""
        return tf.nest.map_structure(lambda _: SUM, zeros)

    def results(self, num_steps: int, totals, waited: Optional[float], busy: Optional[float]) -> Results:
        """The host's Results of one call of num_steps steps from the totals it returned."""
        raise NotImplementedError

    def logs(self, totals) -> dict:
        """{"val_loss": ..., "val_<metric>": ...} of an evaluation from its totals."""
        raise NotImplementedError

    def metric_results(self, states) -> dict:
        """{name: value} of the metrics whose states, summed over train steps, are `states` ({} for none)."""
        return {}

    def state(self) -> dict:
        """What checkpoints hold of this step beside the model and its optimizer, by name ({} for none)."""
        return {}

    def begin_epoch(self):
        """Called when an epoch starts at its first step."""

    def begin_evaluation(self):
        """Called before each evaluation."""

    def before_call(self):
        """Called before each call of train steps."""

    def after_call(self):
        """Called after each call of train steps, once its results are on the host."""


def train_function(step: Step, strategy, parallel_iterations: int = 1, replica_rows: Optional[int] = None):
    """train(iterator, num_steps, skip_first_wait) -> (totals, input wait s, step s): step.train on every replica.

    num_steps steps in one tf.function call (steps_in_one_call), timed; with jit_compile each
    replica's step is one XLA computation (compiled_for_full_batches: replica_rows, the rows of a
    replica's full batch, where every replica gets as many). parallel_iterations: see
    gpupar.training.inner_loop.timed_loop_iterations.
    """
    replica_step = compiled_for_full_batches(step.train, replica_rows) if step.jit_compile else step.train
    zeros = step.train_zeros()
    return steps_in_one_call(replica_step, zeros, timed=True, strategy=strategy, parallel_iterations=parallel_iterations,
                             combine=step.combine, reductions=step.reductions(zeros))


def compiled_for_full_batches(train, rows: Optional[int]):
    """train(batch) as one XLA computation, compiled for a full batch of `rows` rows; other batches run without XLA.

    The K-steps loop hands the step batches whose first dimension is unknown (an epoch may end
    in a smaller one). Traced on such a batch, XLA compiled the step again for every batch,
    taking the tensors' values as compile-time constants (the ConvNet on one CPU: 10 steps took
    185 s against 3.4 s with the batch's shape known). So a full batch is given its static shape
    and runs the compiled step; a smaller one (an epoch's last) runs the same step without XLA.
    rows None (replicas get unequal shares): every batch goes to the compiled step as it is.
    """
    compiled = tf.function(train, jit_compile=True, autograph=False)
    if rows is None:
        return compiled

    def static(t):  # the branch runs only on a full batch: its shape is said, not checked again
        if not isinstance(t, tf.Tensor):
            return t
        known = tf.identity(t)
        known.set_shape([rows, *t.shape[1:]])
        return known

    def replica_step(batch):
        first = next(t for t in tf.nest.flatten(batch) if isinstance(t, tf.Tensor))
        return tf.cond(tf.equal(tf.shape(first)[0], rows), lambda: compiled(tf.nest.map_structure(static, batch)),
                       lambda: train(batch))

    return replica_step


class LocalCalls:
    """Runs a step's calls in this process, one after another: every mode but parameter servers.

    replica_rows: the rows of each replica's full batch, if every replica gets as many
    (compiled_for_full_batches).
    """

    def __init__(self, step: Step, strategy, parallel_iterations: int = 1, replica_rows: Optional[int] = None):
        self.step, self.function = step, train_function(step, strategy, parallel_iterations, replica_rows)

    def run(self, iterator, num_steps: int, first_call: bool = False) -> Results:
        """One call of num_steps steps; its Results on the host."""
        self.step.before_call()
        totals, waited, busy = self.function(iterator, tf.constant(num_steps), tf.constant(first_call))
        results = self.step.results(num_steps, totals, float(waited), float(busy))
        self.step.after_call()
        return results

    def finish(self) -> Results:
        """Nothing is in flight once run() returns."""
        return Results()


def evaluation(step: Step, strategy, iterator, num_steps: int):
    """evaluation() -> the step's logs over num_steps batches of `iterator`: the one evaluation path of every kind."""
    zeros = step.eval_zeros()
    evaluate = steps_in_one_call(step.evaluate, zeros, strategy=strategy, combine=step.combine,
                                 reductions=step.reductions(zeros))

    def run():
        step.begin_evaluation()
        return step.logs(evaluate(iterator, tf.constant(num_steps)))

    return run


def no_evaluation() -> dict:
    """The evaluation of a run without evaluation data."""
    return {}
