"""What a mode is: its refusals, its placement, how it builds the model, and its builder of the Engine.

A mode is one way of training (synchronous data parallelism, model-parallel stages, parameter
servers), one module each beside this one, registered in gpupar.training.modes.
"""

from typing import List, Sequence, Tuple

import tensorflow as tf

from gpupar.errors import GpuparError
from gpupar.training.engine import Engine, Placement, Prepared
from gpupar.training.inner_loop import Results, unpack


class Mode:
    """One way of training. The registry asks `selected`; the run asks the rest in order.

    Attributes:
      name: The mode's name ("synchronous", "model_parallel", "parameter_server"): a strategy name where one names it.
      takes_own_step: Whether the mode runs a model's own train_step; the others refuse such a model.
    """

    name = ""
    takes_own_step = False  # whether it runs a model's own train_step (gpupar.training.own_step)

    def selected(self, distribution, cluster) -> bool:
        """Whether the Distribution options (and the cluster, or None) ask for this mode."""
        raise NotImplementedError

    def refuse_elsewhere(self, distribution):
        """Refuses this mode's own options when another mode runs (checked before TensorFlow starts)."""

    def refuse(self, config):
        """Refuses the Config options this mode cannot run (checked before TensorFlow starts)."""

    def refuse_task(self, task, config):
        """Refuses the input forms this mode cannot take (before TensorFlow starts or a cluster is joined)."""

    def serves(self, cluster) -> bool:
        """Whether this process only serves the others (a parameter server or worker task)."""
        return False

    def serve(self, config, cluster):
        """Serves until the process is stopped (serves() tasks only)."""
        raise NotImplementedError

    def place(self, config, cluster) -> Placement:
        """Makes the strategy (or plans the stages): where replicas and variables go. Starts TensorFlow."""
        raise NotImplementedError

    def build_model(self, build, placement: Placement, sample):
        """The task's model, built under the placement's scope; `sample` is one batch, for a subclassed model."""
        model = build()
        # A subclassed model makes its variables on its first call; one whose layers are all built
        # already (a GAN of two built models, which may have no call() of its own) is left as it is.
        if not model.built and not all(layer.built for layer in model._flatten_layers(include_self=False)):
            model(unpack(sample)[0], training=False)
        return model

    def updated_variables(self, model) -> Tuple[Sequence, List[str]]:
        """(the variables the optimizer updates, one log line per variable split over several devices)."""
        return model.trainable_variables, []

    def build(self, prepared: Prepared) -> Engine:
        """The complete Engine of this mode: its step, its input and its evaluation."""
        raise NotImplementedError


def refuse_own_step(config, strategy_name: str, pipelined: bool = False):
    """Refuses the step options of gpupar's synchronous step in a mode whose step is its own."""
    step = config.step
    if step.accumulate_steps != 1:
        raise GpuparError(f"accumulate_steps={step.accumulate_steps} adds up gradients in a synchronous step; "
                          f"strategy={strategy_name} has steps of its own"
                          + (" (it pipelines micro-batches with microbatches=N)" if pipelined else "")
                          + "; use accumulate_steps=1")
    if step.precision != "float32" or step.jit_compile:
        raise GpuparError(f"precision and jit_compile are not available with strategy={strategy_name} (its step is its "
                          "own); use precision=float32 and no jit_compile")
    if step.nan_policy != "stop":
        raise GpuparError(f"nan_policy=skip drops a step on every replica at once; strategy={strategy_name} has no "
                          "such step (use nan_policy=stop)")


def timed_calls(train, loss_scale=None):
    """run_steps for a train function of steps_in_one_call(timed=True): one call, its Results on the host.

    loss_scale: nan_policy=skip's loss scale, put back to 1 after every call (each skipped step halved it).
    """
    def run_steps(iterator, num_steps, first_call):
        (loss, kept, examples, states), waited, busy = train(iterator, tf.constant(num_steps), tf.constant(first_call))
        if loss_scale is not None:
            loss_scale.assign(1.0)
        return Results(num_steps, float(loss), float(kept), float(examples), [s.numpy() for s in states],
                       float(waited), float(busy))

    return run_steps


def own_step_calls(train, first_step_check):
    """run_steps for a model's own train_step (gpupar.training.own_step): one call, its rows and last logs on the host.

    The first call is checked to have updated something (own_step.FirstStepCheck).
    """
    def run_steps(iterator, num_steps, first_call):
        first_step_check.before()
        (rows, logs), waited, busy = train(iterator, tf.constant(num_steps), tf.constant(first_call))
        first_step_check.after()
        rows = float(rows)
        return Results(num_steps, 0.0, rows, rows, [], float(waited), float(busy),
                       step_logs={name: float(value) for name, value in logs.items()})

    return run_steps
