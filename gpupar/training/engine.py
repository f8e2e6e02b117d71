"""The Engine: everything the outer loop drives for one run, whatever the mode; and what the shared set-up hands a mode.

A mode (gpupar.training.modes) places the replicas and variables (its Placement), the one
set-up (gpupar.training.setup) makes the model, the optimizer, the objective and the input
adapters under that placement (a Prepared), and the mode's builder returns the complete, frozen
Engine. The loop (gpupar.training.loop) and `gpupar diagnose` ask an Engine only what this file
names, and never which mode made it.
"""

import dataclasses
from typing import Any, Callable, Iterator, Optional, Sequence

from gpupar.training.inner_loop import Results
from gpupar.training.step import make_finite_check


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a mode puts its replicas and variables: what the set-up needs before the model.

    Attributes:
      description: The one-line description of the placement (strategy, devices, replicas).
      strategy: The tf.distribute.Strategy whose scope the variables are made under (the default
        strategy where the mode places them itself, by tf.device).
      replicas: Copies of the model computing at once: replicas in sync, pipelined copies of the
        stages, or parameter-server workers.
      replicas_per_update: Replicas whose batches make one update's global batch (1 for
        parameter servers: each worker updates with its own batch).
      input_pipelines: Input pipelines feeding the replicas: one per worker of a cluster.
      devices: The compute devices.
      lockstep_workers: Whether the cluster's workers step in lock step (multi-worker mirrored),
        so that they must agree on when to stop and all save.
      stage_devices: Where each pipeline stage's variables live (model_parallel), else None.
      stage_ends: Where the pipeline's stages end, by layer name or index (model_parallel), else None.
      plan: The mode's own plan: a runtime.strategy.Plan, or a runtime.stages.StagePlan.
    """

    description: str
    strategy: Any
    replicas: int
    replicas_per_update: int
    devices: Sequence[str]
    input_pipelines: int = 1
    lockstep_workers: bool = False
    stage_devices: Optional[Sequence[str]] = None
    stage_ends: Optional[Sequence] = None
    plan: Any = None

    @property
    def on_gpus(self) -> bool:
        """Whether the compute devices are GPUs."""
        return any(d.startswith("/gpu") for d in self.devices)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What the shared set-up made for a mode's builder.

    Attributes:
      placement: The mode's Placement.
      model: The Keras model, built under the placement.
      optimizer: The optimizer whose state checkpoints hold (inside any loss-scale wrapper).
      update_optimizer: What applies the updates: optimizer, or a loss-scale optimizer around it.
      updated_variables: What the optimizer updates (the trainable variables, or their shards).
      objective: The loss and metrics (gpupar.training.objective.Objective).
      train: The training data's adapter, prepared.
      evaluation: The evaluation data's adapter, prepared, or None.
      global_batch: Examples in one update.
      eval_batch: Examples in one evaluation step over all replicas.
      steps_per_epoch: Updates in one epoch.
      distribution: The Config's Distribution options.
      input: The Config's InputOptions.
      step: The Config's StepOptions.
      loop: The Config's LoopOptions.
      seed: The run's seed.
      signature: The model and its shape-defining options, as checkpoints record them.
      learning_rate: The learning rate to put back after restoring a checkpoint, or None.
      visible_gpus: The physical GPUs in use.
      own_step: Whether the model's own train_step is the step (gpupar.training.own_step).
    """

    placement: Placement
    model: Any
    optimizer: Any
    update_optimizer: Any
    updated_variables: Sequence
    objective: Any
    train: Any
    evaluation: Any
    global_batch: int
    eval_batch: int
    steps_per_epoch: int
    distribution: Any
    input: Any
    step: Any
    loop: Any
    seed: int
    signature: dict
    learning_rate: Optional[float]
    visible_gpus: Sequence[int]
    own_step: bool = False

    def engine(self, make_input, run_steps, evaluate, finish=Results, steps_per_call=None) -> "Engine":
        """The complete Engine: the mode's own parts (its input, steps and evaluation) with everything shared.

        steps_per_call None: the loop options' (steps_per_call, else display_step capped at the epoch).
        A model's own train_step keeps its metrics in the model: reset when an epoch begins, as
        model.fit does, and checkpointed, so that an epoch resumed mid-way reports the whole epoch.
        """
        placement = self.placement
        return Engine(
            description=placement.description, strategy=placement.strategy, replicas=placement.replicas,
            model=self.model, optimizer=self.optimizer, update_optimizer=self.update_optimizer,
            objective=self.objective, global_batch=self.global_batch, steps_per_epoch=self.steps_per_epoch,
            steps_per_call=steps_per_call or self.loop.steps_in_a_call(self.steps_per_epoch), make_input=make_input,
            run_steps=run_steps, finish=finish, evaluate=evaluate, weights_finite=make_finite_check(self.model),
            updates=self.optimizer.iterations, signature=self.signature, learning_rate=self.learning_rate,
            visible_gpus=self.visible_gpus, on_gpus=placement.on_gpus, lockstep_workers=placement.lockstep_workers,
            begin_epoch=self.model.reset_metrics if self.own_step else _nothing,
            step_state=tuple(self.model.metrics_variables) if self.own_step else ())


def _nothing():
    """An epoch's beginning where the step keeps no state of its own."""


def no_evaluation() -> dict:
    """The evaluation of a run without evaluation data."""
    return {}


@dataclasses.dataclass(frozen=True)
class Engine:
    """Everything the loop needs for one run, whatever the mode; each field means one thing in every mode.

    Attributes:
      description: The one-line description of the placement (strategy, devices, replicas).
      strategy: The tf.distribute.Strategy whose scope the model's variables were made under.
      replicas: Copies of the model computing at once (Placement.replicas).
      model: The Keras model.
      optimizer: The optimizer whose state checkpoints hold (inside any loss-scale wrapper).
      update_optimizer: What applies the updates: optimizer, or a loss-scale optimizer around it
        (precision=mixed_float16, nan_policy=skip).
      objective: The loss and metrics (gpupar.training.objective.Objective).
      global_batch: Examples in one step, that is one optimizer update (parameter servers: one worker's batch).
      steps_per_epoch: Steps (updates) in one epoch, capped by steps_per_epoch.
      steps_per_call: Steps the loop asks for in one call, unless a boundary cuts it.
      make_input: make_input(first_step, limit=None) -> the training input from that global step.
      run_steps: run_steps(input, num_steps, first_call) -> Results of the steps that finished:
        most modes run num_steps; parameter servers schedule them and report the calls that
        finished meanwhile.
      finish: finish() -> Results of the steps still in flight, once applied.
      evaluate: evaluate() -> {"val_loss": ..., "val_<metric>": ...} of the current weights over the
        whole evaluation set ({} without one).
      weights_finite: weights_finite() -> whether every float weight is finite.
      updates: The optimizer's update counter (it stands still on a skipped step).
      signature: The model and its shape-defining options, as checkpoints record them.
      learning_rate: The learning rate to put back after restoring a checkpoint, or None.
      visible_gpus: The physical GPUs in use (for the utilisation sampler).
      on_gpus: Whether the compute devices are GPUs.
      lockstep_workers: Whether a cluster's workers step in lock step (Placement.lockstep_workers).
      begin_epoch: begin_epoch(), called when an epoch starts at its first step.
      step_state: Variables of the step's own that checkpoints hold besides the model's weights and
        optimizer (a model's own train_step's metrics).
    """

    description: str
    strategy: Any
    replicas: int
    model: Any
    optimizer: Any
    update_optimizer: Any
    objective: Any
    global_batch: int
    steps_per_epoch: int
    steps_per_call: int
    make_input: Callable[..., Iterator]
    run_steps: Callable[..., Results]
    finish: Callable[[], Results]
    evaluate: Callable[[], dict]
    weights_finite: Callable[[], bool]
    updates: Any
    signature: dict
    learning_rate: Optional[float] = None
    visible_gpus: Sequence[int] = ()
    on_gpus: bool = False
    lockstep_workers: bool = False
    begin_epoch: Callable[[], None] = _nothing
    step_state: Sequence = ()

    def start(self, first_step: int, limit: Optional[int] = None):
        """The training input from a global step (after restoring; at most `limit` steps)."""
        return self.make_input(first_step, limit)

    def run_calls(self, iterator, steps: int, first_call: bool = False) -> Results:
        """Runs `steps` steps from `iterator` in calls of steps_per_call, as training does; their summed results.

        For measurements (gpupar diagnose, the benchmarks): the training loop cuts its calls at
        checkpoint and profile boundaries too.
        """
        total, done = Results(), 0
        while done < steps:
            num = min(self.steps_per_call, steps - done)
            total += self.run_steps(iterator, num, first_call and done == 0)
            done += num
        return total
