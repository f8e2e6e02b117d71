"""The Trainer: one run's model, optimizer, strategy, input, step and state, built once; and a mode's Placement.

A mode (gpupar.training.modes) places the replicas and variables (its Placement); the one set-up
(gpupar.training.setup.build_trainer) builds everything else under that placement and makes the
Trainer once, complete. The outer loop (gpupar.training.loop), the checkpoints and `gpupar
diagnose` ask a Trainer only what this file names, and never which mode made it.
"""

import dataclasses
from typing import Any, Callable, Iterator, Optional, Sequence

import keras

from gpupar.training.inner_loop import Results
from gpupar.training.steps.step import Step


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a mode puts its replicas and variables: what the set-up needs before the model.

    Attributes:
      description: The one-line description of the placement (strategy, devices, replicas).
      strategy: The tf.distribute.Strategy whose scope the variables are made under (the default
        strategy where the mode places them itself, by tf.device).
      replicas: Replicas whose shares of the batch make one update: replicas in sync, or pipelined
        copies of the stages (1 for parameter servers: each worker updates with its own batch).
      devices: The compute devices.
      workers: Parameter-server workers, each updating on its own (1 in every other mode).
      input_pipelines: Input pipelines feeding the replicas: one per worker of a cluster.
      lockstep_workers: Whether the cluster's workers step in lock step (multi-worker mirrored),
        so that they must agree on when to stop and all save.
      plan: The mode's own plan: a runtime.strategy.Plan, or a runtime.stages.StagePlan.
    """

    description: str
    strategy: Any
    replicas: int
    devices: Sequence[str]
    workers: int = 1
    input_pipelines: int = 1
    lockstep_workers: bool = False
    plan: Any = None

    @property
    def on_gpus(self) -> bool:
        """Whether the compute devices are GPUs."""
        return any(d.startswith("/gpu") for d in self.devices)


@dataclasses.dataclass(frozen=True)
class Trainer:
    """One run, complete: what the loop drives, what checkpoints hold (by name), whatever the mode.

    Attributes:
      placement: The mode's Placement.
      model: The Keras model.
      optimizer: The optimizer whose state checkpoints hold (inside any loss-scale wrapper).
      loss_scale: precision=mixed_float16's keras.optimizers.LossScaleOptimizer, whose dynamic
        scale checkpoints hold, else None.
      step: The Step (gpupar.training.steps): what a replica does with a batch.
      calls: Runs calls of train steps: run(iterator, num_steps, first_call) -> Results of the
        steps that finished (a parameter-server scheduler reports calls later than asked);
        finish() -> Results of the steps still in flight, once applied; metrics() -> the model's
        metrics as the host can read them meanwhile (keras_logs).
      make_input: make_input(first_step, limit=None) -> the training input from that global step.
      evaluate: evaluate(callbacks=None) -> {"val_loss": ..., "val_<metric>": ...} of the current
        weights over the whole evaluation set ({} without one); `callbacks` (an Observer) hears
        Keras' test hooks.
      weights_finite: weights_finite() -> whether every float weight is finite.
      global_batch: Examples in one update, over the replicas that make it.
      steps_per_epoch: Updates in one epoch, capped by steps_per_epoch.
      steps_per_call: Steps the loop asks for in one call, unless a boundary cuts it.
      signature: The model and its shape-defining options, as checkpoints record them.
      learning_rate: The learning rate to put back after restoring a checkpoint, or None.
      visible_gpus: The physical GPUs in use (for the utilisation sampler).
      global_random_state: Random state outside the model that checkpoints hold (Keras' global SeedGenerator's),
        saved as "global_random_state" (the model's own is checkpoint.model_random_state).
      variables: The variables the optimizer updates (the model's trainable ones, or their shards).
    """

    placement: Placement
    model: Any
    optimizer: Any
    loss_scale: Any
    step: Step
    calls: Any
    make_input: Callable[..., Iterator]
    evaluate: Callable[..., dict]
    weights_finite: Callable[[], bool]
    global_batch: int
    steps_per_epoch: int
    steps_per_call: int
    signature: dict
    learning_rate: Optional[float] = None
    visible_gpus: Sequence[int] = ()
    global_random_state: Sequence = ()
    variables: Sequence = ()

    @property
    def strategy(self):
        return self.placement.strategy

    @property
    def description(self) -> str:
        return self.placement.description

    @property
    def replicas(self) -> int:
        return self.placement.replicas

    @property
    def on_gpus(self) -> bool:
        return self.placement.on_gpus

    @property
    def updates(self):
        """The optimizer's update counter (it stands still on a skipped step)."""
        return self.optimizer.iterations

    def state(self) -> dict:
        """What checkpoints hold, by name: the model, its optimizer, random state outside the model, the step's own."""
        return {"model": self.model, "optimizer": self.optimizer, "global_random_state": list(self.global_random_state),
                **self.step.state()}

    def start(self, first_step: int, limit: Optional[int] = None):
        """The training input from a global step (after restoring; at most `limit` steps)."""
        return self.make_input(first_step, limit)

    def finish(self) -> Results:
        """Results of the steps still in flight, once applied."""
        return self.calls.finish()

    def logs(self, step_logs: Optional[dict] = None) -> dict:
        """The logs of the epoch's steps so far, as Keras' fit takes them (Step.logs), also while steps are in flight."""
        return self.step.logs(step_logs, self.calls.metrics())

    def begin_epoch(self):
        """Called when an epoch starts at its first step."""
        self.step.begin_epoch()

    def finalize(self):
        """What Keras' fit does once training ends: the optimizer's end-of-training swaps (use_ema's averages)."""
        optimizer = self.model.optimizer
        if isinstance(optimizer, keras.optimizers.Optimizer):
            optimizer.finalize_variable_values(list(self.variables) or self.model.trainable_weights)

    def run_calls(self, iterator, steps: int, first_call: bool = False) -> Results:
        """Runs `steps` steps from `iterator` in calls of steps_per_call, as training does; their summed results.

        For measurements (gpupar diagnose, the benchmarks): the training loop cuts its calls at
        checkpoint and profile boundaries too.
        """
        total, done = Results(), 0
        while done < steps:
            num = min(self.steps_per_call, steps - done)
            total += self.calls.run(iterator, num, first_call and done == 0)
            done += num
        return total
