"""Which layers make which pipeline stage, and which device runs which stage of which replica (model_parallel).

`stage_of_layers` and `plan_stages` are pure functions of layer names and device names, so
tests call them with fake ones; gpupar/models/staged.py and gpupar/training/pipeline.py carry
the plan out.
"""

import dataclasses
from typing import List, Sequence, Tuple, Union

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
            f"devices (e.g. virtual_cpus={num_stages} without GPUs), or fewer stages"
        )
    num_replicas = len(devices) // num_stages
    used = num_replicas * num_stages
    replicas = tuple(devices[r * num_stages:(r + 1) * num_stages] for r in range(num_replicas))
    return StagePlan(replicas, devices[used:])


def stage_of_layers(names: Sequence[str], ends: Sequence[Union[str, int]]) -> List[int]:
    """The stage of each layer of a chain, from the layers after which a new stage starts.

    Args:
      names: The chain's layer names, in order.
      ends: The last layer of every stage but the last, by name or index into `names`.

    Returns:
      One stage number per layer: len(ends) + 1 stages.

    Raises:
      GpuparError: a layer that is not there, ends out of order, or a stage with no layer.
    """
    listed = ", ".join(f"{i}: {name}" for i, name in enumerate(names))
    positions = []
    for end in ends:
        if isinstance(end, int):
            if not 0 <= end < len(names):
                raise GpuparError(f"stages: layer {end} does not exist; the model's layers are {listed}")
            positions.append(end)
        elif end in names:
            positions.append(names.index(end))
        else:
            raise GpuparError(f"stages: the model has no layer {end!r}; its layers are {listed}")
    if any(b <= a for a, b in zip(positions, positions[1:])) or (positions and positions[-1] >= len(names) - 1):
        raise GpuparError(f"stages={tuple(ends)}: name the layers where each stage but the last ends, in order and "
                          f"before the last layer (the last stage ends with the model); the layers are {listed}")
    return [sum(i > end for end in positions) for i in range(len(names))]
