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


def train_function(step: Step, strategy, parallel_iterations: int = 1):
    """train(iterator, num_steps, skip_first_wait) -> (totals, input wait s, step s): step.train on every replica.

    num_steps steps in one tf.function call (steps_in_one_call), timed; with jit_compile each
    replica's step is one XLA computation. parallel_iterations: see
    gpupar.training.inner_loop.timed_loop_iterations.
    """
    replica_step = tf.function(step.train, jit_compile=True, autograph=False) if step.jit_compile else step.train
    zeros = step.train_zeros()
    return steps_in_one_call(replica_step, zeros, timed=True, strategy=strategy, parallel_iterations=parallel_iterations,
                             combine=step.combine, reductions=step.reductions(zeros))


class LocalCalls:
    """Runs a step's calls in this process, one after another: every mode but parameter servers."""

    def __init__(self, step: Step, strategy, parallel_iterations: int = 1):
        self.step, self.function = step, train_function(step, strategy, parallel_iterations)

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
