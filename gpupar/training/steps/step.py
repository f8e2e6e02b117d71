"""What a kind of step is, and the two ways every kind runs: K train steps per call, and one evaluation.

A Step is what one replica does with one batch: `train_step(batch)` (forward, loss, gradients,
update, metrics) and `test_step(batch)`, as Keras names them, each returning values that the K-steps call
(gpupar.training.inner_loop.InnerLoop) adds up over steps and replicas on the devices,
and that the host reads once per call (`results`). The metrics are the model's own Keras metrics,
read on the host as Keras' fit reads them (`logs`). Every kind (the compiled model's step, the
model's own train_step, the pipelined stages) runs through `train_function` and `Evaluation`
below; a mode decides only where and how often the calls run.
"""

import contextlib
from typing import Optional

import numpy as np
import tensorflow as tf

from gpupar import keras_compat
from gpupar.training.inner_loop import SUM, InnerLoop, Results


def keras_logs(model) -> dict:
    """The model's metrics as Keras' fit logs them (Model.get_metrics_result()), read here."""
    return as_logs(model.get_metrics_result())


def as_logs(metrics) -> dict:
    """Metric results (tensors, or values fetched from a worker) as Keras' fit logs them: Python numbers, or NumPy
    arrays (a metric of several values, F1Score per class, Precision at several thresholds, as Keras gives them)."""
    logs = {}
    for name, value in metrics.items():
        value = np.asarray(value)
        logs[name] = float(value) if value.ndim == 0 else value
    return logs


class Step:
    """One kind of step, per replica. Subclasses define train_step, test_step and their zeros; the rest has defaults.

    Attributes:
      model: The Keras model the step trains.
      optimizer: The optimizer whose update counter counts the steps (and whose state checkpoints hold).
      jit_compile: Whether each replica's train step is one XLA computation.
      run_eagerly: Whether the steps run eagerly, not in a tf.function (compile's run_eagerly, for debugging).
      runs_replicas: Whether train_step() and test_step() run every replica themselves (strategy.run), across the
        replicas; else they are one replica's, and the K-steps call runs them on each.
      state_variables: The Keras variables the steps carry as `states` (gpupar.training.inner_loop).
    """

    jit_compile = False
    run_eagerly = False
    runs_replicas = False

    @property
    def state_variables(self) -> list:
        """The Keras variables whose values the steps carry as `states` (the compiled metrics'); [] for none."""
        return []

    def train_zeros(self):
        """Zeros shaped like the values train_step() returns."""
        raise NotImplementedError

    def train_step(self, batch, states):
        """One replica's train step on its share of the batch: (values shaped like train_zeros(), the new states)."""
        raise NotImplementedError

    def test_zeros(self):
        """Zeros shaped like the values test_step() returns."""
        raise NotImplementedError

    def test_step(self, batch, states):
        """One replica's evaluation of its share of the batch: (values shaped like test_zeros(), the new states)."""
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

    def step_logs(self, totals) -> Optional[dict]:
        """The logs an evaluation's last step returned, where the kind's steps return logs (else None)."""
        return None

    def logs(self, step_logs: Optional[dict] = None, metrics: Optional[dict] = None) -> dict:
        """The logs of the steps since the metrics were reset, as Keras' fit takes them.

        The model's metrics (Keras' get_metrics_result, summed over replicas as each variable
        declares; `metrics` where they were read elsewhere, else read here), unless a step returned
        logs of other names (a model's own train_step): then those, its last (Keras'
        Trainer._get_metrics_result_or_logs).
        """
        metrics = keras_logs(self.model) if metrics is None else metrics
        if step_logs is None or set(step_logs) == set(metrics):
            return metrics
        return dict(step_logs)

    def state(self) -> dict:
        """What checkpoints hold of this step beside the model and its optimizer: the model's metrics, by name."""
        variables = list(self.model.metrics_variables)
        return {"step_state": variables} if variables else {}

    def begin_epoch(self):
        """Called when an epoch starts at its first step: the metrics start again, as in Keras' fit."""
        self.model.reset_metrics()

    def begin_evaluation(self):
        """Called before each evaluation: the metrics start again, as in Keras' evaluate."""
        self.model.reset_metrics()

    @contextlib.contextmanager
    def in_call(self):
        """What holds while the step's functions are called, and so traced: Keras' per-replica semantics."""
        with keras_compat.per_replica_semantics():
            yield

    def before_call(self):
        """Called before each call of train steps."""

    def after_call(self):
        """Called after each call of train steps, once its results are on the host."""


def train_function(step: Step, strategy, parallel_iterations: int = 10, replica_rows: Optional[int] = None):
    """train(iterator, num_steps, skip_first_wait) -> (totals, input wait s, step s): step.train_step on every replica.

    The step's InnerLoop, the one K-steps call of every mode; with jit_compile each replica's step
    is one XLA computation, compiled for a full batch of replica_rows rows (InnerLoop's
    full_rows). parallel_iterations: see gpupar.training.inner_loop.timed_loop_iterations.
    """
    zeros = step.train_zeros()
    return InnerLoop(step.train_step, zeros, None if step.runs_replicas else strategy, parallel_iterations, step.combine,
                     step.reductions(zeros), step.state_variables, eager=step.run_eagerly,
                     jit_compile=step.jit_compile and not step.runs_replicas, full_rows=replica_rows).call


class LocalCalls:
    """Runs a step's calls in this process, one after another: every mode but parameter servers.

    replica_rows: the rows of each replica's full batch, if every replica gets as many
    (InnerLoop's full_rows).
    """

    def __init__(self, step: Step, strategy, parallel_iterations: int = 1, replica_rows: Optional[int] = None):
        self.step, self.function = step, train_function(step, strategy, parallel_iterations, replica_rows)

    def run(self, iterator, num_steps: int, first_call: bool = False) -> Results:
        """One call of num_steps steps; its Results on the host."""
        self.step.before_call()
        with self.step.in_call():
            totals, waited, busy = self.function(iterator, tf.constant(num_steps), tf.constant(first_call))
        results = self.step.results(num_steps, totals, float(waited), float(busy))
        self.step.after_call()
        return results

    def finish(self) -> Results:
        """Nothing is in flight once run() returns."""
        return Results()

    def metrics(self) -> dict:
        """The model's metrics, read here: nothing is in flight."""
        return keras_logs(self.step.model)


class Evaluation:
    """The evaluation of the current weights over a whole evaluation set: one path for every kind of step.

    It runs the step's test_step on every replica in calls of `steps_per_call` steps, and tells
    `callbacks` (an object with Keras' test hooks, or None) as Keras' evaluate tells its
    callbacks: on_test_begin, on_test_batch_begin/end around each call, on_test_end.
    """

    def __init__(self, step: Step, strategy, iterator, num_steps: int, steps_per_call: int = 1):
        self.step, self.iterator, self.num_steps, self.steps_per_call = step, iterator, num_steps, steps_per_call
        zeros = step.test_zeros()
        # As Keras' evaluate: compile's jit_compile compiles the test step too.
        self.function = InnerLoop(step.test_step, zeros, None if step.runs_replicas else strategy, combine=step.combine,
                                  reductions=step.reductions(zeros), state_variables=step.state_variables,
                                  eager=step.run_eagerly,
                                  jit_compile=step.jit_compile and not (step.run_eagerly or step.runs_replicas)).call

    def __call__(self, callbacks=None) -> dict:
        """{"val_loss": ..., "val_<metric>": ...} of the whole evaluation set."""
        self.step.begin_evaluation()
        if callbacks is not None:
            callbacks.on_test_begin()
        done, last = 0, None
        with self.step.in_call():
            while done < self.num_steps:
                num = min(self.steps_per_call, self.num_steps - done)
                if callbacks is not None:
                    callbacks.on_test_batch_begin(done)
                last = self.step.step_logs(self.function(self.iterator, tf.constant(num))[0])
                done += num
                if callbacks is not None:
                    callbacks.on_test_batch_end(done - 1, self.step.logs(last))
        logs = self.step.logs(last)
        if callbacks is not None:
            callbacks.on_test_end(logs)
        return {f"val_{name}": value for name, value in logs.items()}


def no_evaluation(callbacks=None) -> dict:
    """The evaluation of a run without evaluation data."""
    return {}
