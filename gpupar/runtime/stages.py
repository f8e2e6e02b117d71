"""Which device runs which pipeline stage of which replica (strategy=model_parallel).

`plan_stages` is a pure function of the device names, so tests call it with fake GPUs;
gpupar/training/pipeline.py carries the plan out.
"""

import dataclasses
from typing import Sequence, Tuple

from gpupar.errors import GpuparError


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """A model-parallel placement: replicas x stages of devices.

    Attributes:
      replicas: For each data-parallel replica, the device of each stage, in stage order.
        Stage k's variables live on replica 0's stage-k device; the other replicas read them
        from there and send their gradients back to it.
      unused: Devices left over when their number is not a multiple of the stages.
    """

    replicas: Tuple[Tuple[str, ...], ...]
    unused: Tuple[str, ...] = ()

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def num_stages(self) -> int:
        return len(self.replicas[0])

    @property
    def variable_devices(self) -> Tuple[str, ...]:
        """Where each stage's variables live."""
        return self.replicas[0]

    def describe(self) -> str:
        """One log line: replicas, stages and devices."""
        groups = "; ".join(f"replica {r}: {' -> '.join(devices)}" for r, devices in enumerate(self.replicas))
        unused = f"; unused: {', '.join(self.unused)}" if self.unused else ""
        return (
            f"strategy: model parallel, {self.num_replicas} replica{'s' if self.num_replicas > 1 else ''} x "
            f"{self.num_stages} stage{'s' if self.num_stages > 1 else ''} ({groups}){unused}"
        )


def plan_stages(devices: Sequence[str], num_stages: int) -> StagePlan:
    """Puts consecutive stages on consecutive devices, as many whole replicas as the devices hold.

    With 4 devices and 2 stages: replica 0 on devices 0 -> 1, replica 1 on devices 2 -> 3.

    Args:
      devices: The devices' names, in order (fake ones in tests).
      num_stages: The model's stages.

    Returns:
      The StagePlan; devices left over are in its `unused`.

    Raises:
      GpuparError: fewer devices than stages, or no stage.
    """
    devices = tuple(devices)
    if num_stages < 1:
        raise GpuparError(f"a pipeline needs at least one stage, got {num_stages}")
    if len(devices) < num_stages:
        raise GpuparError(
            f"strategy=model_parallel puts each of the model's {num_stages} stages on its own device, but "
            f"only {len(devices)} device(s) are available ({', '.join(devices)}); use at least {num_stages} "
            f"devices (e.g. virtual_cpus={num_stages} without GPUs), or a model with fewer stages "
            "(lstm_layers)"
        )
    num_replicas = len(devices) // num_stages
    used = num_replicas * num_stages
    replicas = tuple(devices[r * num_stages:(r + 1) * num_stages] for r in range(num_replicas))
    return StagePlan(replicas, devices[used:])
