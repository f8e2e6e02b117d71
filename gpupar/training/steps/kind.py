"""What a kind of step is to the set-up: which models it trains, what it refuses, and how it is built.

A StepKind is chosen once per run, from the model and the mode (gpupar.training.steps.step_kind),
as soon as the model exists; its `build` makes the Step (gpupar.training.steps.step) from one
StepRequest. Every kind is one class beside its Step, registered in gpupar.training.steps.KINDS.
"""

import dataclasses
from typing import Any, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class StepRequest:
    """Everything a kind of step may need to build its Step, made once by the set-up.

    Attributes:
      model: The Keras model, built and compiled under the placement.
      optimizer: The optimizer whose state checkpoints hold (inside any loss-scale wrapper).
      update_optimizer: What applies the updates: the optimizer, or a loss-scale optimizer around it.
      variables: What the optimizer updates: the model's trainable variables, or their shards.
      options: The run's StepOptions (accumulate_steps, nan_policy, precision, jit_compile), resolved.
      mode: The run's Mode (its Distribution options: stages, microbatches).
      placement: The mode's Placement (its strategy, replicas, plan).
      train: The training data's adapter (gpupar.data.adapters).
      validation: The validation data's adapter, or None.
      global_batch: Examples in one update.
      eval_batch: Examples in one evaluation step.
      validation_steps: The evaluation's steps where given, else None (the whole set).
    """

    model: Any
    optimizer: Any
    update_optimizer: Any
    variables: Sequence
    options: Any
    mode: Any
    placement: Any
    train: Any
    validation: Any = None
    global_batch: int = 0
    eval_batch: int = 0
    validation_steps: Optional[int] = None


class StepKind:
    """One kind of step: which models and placements it trains, what it refuses, and its build.

    Attributes:
      name: The kind's name, as logs and errors give it.
      own_update: The model's own train_step applies its updates: its compile's optimizers are
        used as they are, and it builds what the step needs itself when first traced (else gpupar
        builds the model, its compiled loss and metrics, and the optimizer on the variables).
    """

    name = ""
    own_update = False

    def applies(self, model, placement) -> bool:
        """Whether this kind trains `model` on `placement` (kinds are asked in KINDS' order)."""
        raise NotImplementedError

    def refusal(self, model, mode, options) -> Optional[str]:
        """Why this kind cannot train `model` in `mode` with the StepOptions, in one line; None where it can."""
        return None

    def build(self, request: StepRequest):
        """The Step (gpupar.training.steps.step.Step) of the run; checks of the model that need its data go here."""
        raise NotImplementedError
