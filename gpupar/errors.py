"""The one exception type users see from gpupar."""


class GpuparError(ValueError):
    """A user-facing error: the message says what was wrong and what to do about it."""
