"""One step per kind, each readable top to bottom, all run through one K-steps call and one evaluation path.

    kind.py       StepKind (which models a kind trains, what it refuses, its build) and StepRequest
    step.py       Step (what every kind offers), train_function, LocalCalls, evaluation
    parts.py      the pieces kinds share: float32 outputs, the forward pass, loss and gradients, accumulation, skips
    compiled.py   KerasCompiledStep (Keras' compiled loss and metrics over the global batch), CompiledStep
    own.py        OwnStep: the model's own train_step and test_step
    pipelined.py  PipelineStep: a chain model's stages over micro-batches (model_parallel)

Adding a kind of step is one module with a StepKind and its Step, and one `register` call.
"""

from gpupar.errors import GpuparError
from gpupar.training.steps.compiled import CompiledKind
from gpupar.training.steps.kind import StepKind, StepRequest
from gpupar.training.steps.own import OwnKind
from gpupar.training.steps.pipelined import PipelinedKind

# Asked in this order; the first that applies trains the model. CompiledKind takes whatever is left.
KINDS = [OwnKind(), PipelinedKind(), CompiledKind()]

__all__ = ["KINDS", "StepKind", "StepRequest", "register", "step_kind"]


def register(kind: StepKind) -> StepKind:
    """Adds a kind of step, asked before the built-in ones (a kind for some models, ahead of the general ones)."""
    KINDS.insert(0, kind)
    return kind


def step_kind(model, mode, placement, options) -> StepKind:
    """The kind of step that trains `model` in `mode` on `placement` with the StepOptions: the first that applies.

    Raises:
      GpuparError: the kind that applies cannot run in this mode or with these options (its refusal).
    """
    kind = next(kind for kind in KINDS if kind.applies(model, placement))
    refusal = kind.refusal(model, mode, options)
    if refusal:
        raise GpuparError(refusal)
    return kind
