"""The exception types users see from gpupar."""


class GpuparError(ValueError):
    """A user-facing error: the message says what was wrong and what to do about it."""


class TensorFlowStarted(GpuparError):
    """TensorFlow ran in this process before gpupar could set up its devices or join a cluster.

    Device settings (virtual CPUs, GPU memory, visible GPUs) and a multi-worker strategy must come
    before TensorFlow's first op; gpupar.fit adds to the message what in its arguments started it.
    """
