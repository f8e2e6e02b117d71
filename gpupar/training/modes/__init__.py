"""The modes, one module each, and the registry that the run, the presets, diagnose and the CLI ask once.

>>> import gpupar
>>> from gpupar.training import modes
>>> mode = modes.checked(gpupar.Config(strategy="model_parallel", microbatches=4))
>>> mode.name, mode.replicas_step_together, mode.distribution.microbatches
('model_parallel', False, 4)

Adding a mode is one module with a Mode subclass (its names, options and capabilities declared
on the class) and one entry in MODES; its name is a value of the `strategy` option (config.py).
"""

import dataclasses

from gpupar.config import Distribution, StepOptions
from gpupar.errors import GpuparError
from gpupar.runtime.cluster import detect_cluster
from gpupar.training.modes.mode import Mode
from gpupar.training.modes.model_parallel import ModelParallel
from gpupar.training.modes.parameter_server import ParameterServer
from gpupar.training.modes.synchronous import Synchronous

# Asked in this order; the first whose selected() is true runs. Synchronous takes whatever is left.
MODES = (ModelParallel, ParameterServer, Synchronous)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Distribution)}
_STEP_DEFAULTS = StepOptions()

__all__ = ["MODES", "Mode", "checked", "select"]


def select(distribution, cluster=None) -> type:
    """The Mode class the Distribution options ask for; with a cluster, strategy=auto may mean parameter servers."""
    return next(mode for mode in MODES if mode.selected(distribution, cluster))


def checked(config, cluster=None) -> Mode:
    """The mode of `config` (and the cluster: TF_CONFIG's or SLURM's where not given), made with its Distribution part,
    after every refusal of the options. Each entry point (gpupar.fit, fit_mnist, diagnose, the command) asks once.

    Everything here is decided from the options alone, before TensorFlow starts.

    Raises:
      GpuparError: an option the mode cannot run, or one of another mode's.
    """
    distribution = config.distribution
    if cluster is None:
        cluster = detect_cluster(slurm_ps=distribution.slurm_ps)
    chosen = select(distribution, cluster)
    for other in MODES:
        for option, what in other.options.items():
            value = getattr(distribution, option)
            if other is not chosen and value != _DEFAULTS[option]:
                shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
                raise GpuparError(f"{option}={shown} {what} strategy={other.name}; pass strategy={other.name}, or "
                                  f"drop {option}")
    mode = chosen(distribution)
    if not mode.takes_step_options:
        _refuse_step_options(config.step_options, mode.name)
    for option, why in mode.refused_loop_options.items():
        if getattr(config.loop, option) is not None:
            raise GpuparError(f"{option} is not available with strategy={mode.name} ({why}); drop it")
    mode.refuse(config.input)
    return mode


def _refuse_step_options(step, name: str):
    """Refuses the step options of gpupar's synchronous step in a mode whose step is its own."""
    if step.accumulate_steps != 1:
        raise GpuparError(f"accumulate_steps={step.accumulate_steps} adds up gradients in a synchronous step; "
                          f"strategy={name} has steps of its own; use accumulate_steps=1")
    if step.precision not in (_STEP_DEFAULTS.precision, "auto") or step.jit_compile:  # auto: float32 there
        raise GpuparError(f"precision and jit_compile are not available with strategy={name} (its step is its own); "
                          "use precision=float32 and no jit_compile")
    if step.nan_policy != _STEP_DEFAULTS.nan_policy:
        raise GpuparError(f"nan_policy=skip drops a step on every replica at once; strategy={name} has no such step "
                          "(use nan_policy=stop)")
