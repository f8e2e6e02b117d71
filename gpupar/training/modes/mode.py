"""What a mode is: its declaration (names, options, capabilities) and the parts of a run it builds.

A mode is one way of training (synchronous data parallelism, model-parallel stages, parameter
servers), one module each beside this one, registered in gpupar.training.modes. Everything
outside modes/ asks the chosen mode's declared capabilities; none compares mode names. A mode
does not build the step: the kind of step (gpupar.training.steps.step_kind) is chosen from the
model and the placement, and the mode takes the Step it builds (calls, evaluation).
"""

from typing import Dict, List, Sequence, Tuple

from gpupar.training.steps.step import Evaluation, LocalCalls, no_evaluation
from gpupar.training.trainer import Placement


class Mode:
    """One way of training, made for one run with its own part of the Config (Distribution).

    Declared by each mode's class, read before TensorFlow starts:
      name: The mode's name, as logs and errors give it.
      strategies: The `strategy` values that select it (selected() may take a cluster's word too).
      options: {Distribution field: what it does} of the fields that are this mode's own; any
        other mode refuses them when they are given.
      takes_built_model: Trains a model built before the call (gpupar.fit(model, ...)), rather than
        only one it builds itself from a function.
      takes_step_options: Runs the step options (accumulate_steps, precision, nan_policy, jit_compile).
      refused_loop_options: LoopOptions fields it cannot run, and why (one phrase).
      replicas_step_together: Its replicas apply one update together, so batch-norm statistics can
        be synchronised over them, input transforms run alike on each, and a model's own
        train_step runs on each (gpupar.training.steps.own.OwnKind).
      batch_norm: How batch norm normalises where replicas do not step together (for errors).
      diagnosable: gpupar diagnose can time its step alone, its pipeline alone and both together.
      steps_per_call: Train steps per call where the options give none; None: the loop options' rule.
    """

    name = ""
    strategies: Tuple[str, ...] = ()
    options: Dict[str, str] = {}
    takes_built_model = True
    takes_step_options = False
    refused_loop_options: Dict[str, str] = {}
    replicas_step_together = False
    batch_norm = ""
    diagnosable = False
    steps_per_call = None

    def __init__(self, distribution):
        self.distribution = distribution

    @classmethod
    def selected(cls, distribution, cluster) -> bool:
        """Whether the Distribution options (and the cluster, or None) ask for this mode."""
        return distribution.strategy in cls.strategies

    def refuse(self, input_options):
        """Refuses the input options this mode cannot run (checked before TensorFlow starts)."""

    def refuse_task(self, task):
        """Refuses the input forms this mode cannot take (before TensorFlow starts or a cluster is joined)."""

    def serves(self, cluster) -> bool:
        """Whether this process only serves the others (a parameter server or worker task)."""
        return False

    def serve(self, device_setup, cluster):
        """Serves until the process is stopped (serves() tasks only)."""
        raise NotImplementedError

    def place(self, device_setup, cluster) -> Placement:
        """Makes the strategy (or plans the stages): where replicas and variables go. Starts TensorFlow."""
        raise NotImplementedError

    def jit_refusal(self, placement: Placement):
        """Why XLA cannot compile a replica's step on this placement (said in the log), or None where it can."""
        return None

    def build_model(self, build, placement: Placement):
        """The task's model, made under the placement's scope (its variables are made by the set-up's build, as Keras')."""
        return build()

    def updated_variables(self, model) -> Tuple[Sequence, List[str]]:
        """(the variables the optimizer updates, one log line per variable split over several devices)."""
        return model.trainable_variables, []

    def calls(self, step, placement, replica_rows):
        """What runs calls of the step's train steps (LocalCalls, or a scheduler of the workers).

        replica_rows: the rows of each replica's full batch, None where replicas get unequal shares.
        """
        return LocalCalls(step, placement.strategy, replica_rows=replica_rows)

    def make_input(self, train, placement: Placement, global_batch: int):
        """make_input(first_step, limit=None) -> the training input of this mode from a global step."""
        raise NotImplementedError

    def make_evaluate(self, step, data, placement: Placement, eval_batch: int, validation_steps, steps_per_call: int):
        """evaluate(callbacks) -> the logs of the validation data (an adapter, or None): Trainer.evaluate."""
        if data is None:
            return no_evaluation
        dataset, steps = data.validation_batches(eval_batch, validation_steps)
        return Evaluation(step, None, iter(dataset), steps, steps_per_call)
