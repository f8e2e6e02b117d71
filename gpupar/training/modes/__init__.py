"""The modes, one module each, and the registry that the run, the presets, diagnose, the CLI and the benchmarks ask.

    mode = modes.checked(config, cluster)   # the mode the options (and the cluster) ask for, its refusals done
    engine = build_engine(config, task, mode, cluster)

Adding a mode is one module with a Mode subclass and one entry in MODES.
"""

from gpupar.config import MODEL_PARALLEL
from gpupar.training.modes.mode import Mode
from gpupar.training.modes.model_parallel import ModelParallel
from gpupar.training.modes.parameter_server import ParameterServer
from gpupar.training.modes.synchronous import Synchronous

# Asked in this order; the first whose selected() is true runs. Synchronous takes whatever is left.
MODES = (ModelParallel(), ParameterServer(), Synchronous())

__all__ = ["MODEL_PARALLEL", "MODES", "Mode", "checked", "select"]


def select(distribution, cluster=None) -> Mode:
    """The mode the Distribution options ask for; with a cluster, strategy=auto may mean parameter servers."""
    return next(mode for mode in MODES if mode.selected(distribution, cluster))


def checked(config, cluster=None) -> Mode:
    """The mode of `config` (and `cluster`), after its refusals and those of the other modes' options.

    Everything here is decided from the options alone, before TensorFlow starts.

    Raises:
      GpuparError: an option the mode cannot run, or one of another mode's.
    """
    mode = select(config.distribution, cluster)
    for other in MODES:
        if other is not mode:
            other.refuse_elsewhere(config.distribution)
    mode.refuse(config)
    return mode
