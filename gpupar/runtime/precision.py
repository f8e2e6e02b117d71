"""Which 16-bit number format the devices' matrix units take: a pure planner of the devices, and one reader of the machine.

`plan_precision` decides from the device list alone (tests give it made-up CPUs and GPUs):
bfloat16 where the matrix units take it (CPUs with AMX-BF16 or AVX512-BF16, GPUs of compute
capability 8.0 and up), float16 with loss scaling on tensor-core GPUs of 7.x, float32 otherwise.
`machine_precision` reads this machine's CPU flags and GPUs' capabilities and asks it.
"""

import dataclasses
import functools
from typing import Optional, Sequence, Tuple

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo's names of the bfloat16 matrix units


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """A precision decision.

    Attributes:
      precision: float32, mixed_bfloat16 or mixed_float16.
      reason: Why, in a few words (what the devices have).
    """

    precision: str
    reason: str

    @property
    def fast(self) -> bool:
        """Whether it is a 16-bit format, faster than float32 on these devices."""
        return self.precision != "float32"


def plan_precision(cpu_flags: Sequence[str] = (), gpu_capabilities: Sequence[Optional[Tuple[int, int]]] = ()
                   ) -> PrecisionPlan:
    """The number format of these devices' matrix units that trains as well as float32.

    Faster than float32 on large matrix products; on small models the casts around them can cost
    more than they save (the MNIST preset's ConvNet on an AMX-BF16 CPU: 0.80x), which
    `gpupar diagnose` measures on the user's model.

    Args:
      cpu_flags: The CPU's feature flags, as /proc/cpuinfo names them (amx_bf16, avx512_bf16, ...).
      gpu_capabilities: Each GPU's CUDA compute capability (major, minor), None where unknown;
        empty for a machine without GPUs (the CPU computes).

    Returns:
      The PrecisionPlan: every GPU of 8.0 or more, bfloat16; every GPU of 7.0 or more, float16
      with loss scaling; on CPUs, bfloat16 where they have bfloat16 matrix units; else float32.
    """
    if gpu_capabilities:
        if any(c is None for c in gpu_capabilities):
            return PrecisionPlan("float32", "a GPU of unknown compute capability")
        lowest = min(gpu_capabilities)
        shown = ".".join(map(str, lowest))
        if lowest >= (8, 0):
            return PrecisionPlan("mixed_bfloat16", f"GPUs of compute capability {shown}+ compute bfloat16 natively")
        if lowest >= (7, 0):
            return PrecisionPlan("mixed_float16", f"GPUs of compute capability {shown} have float16 tensor cores")
        return PrecisionPlan("float32", f"GPUs of compute capability {shown} have no 16-bit matrix units")
    units = [flag for flag in BF16_CPU_FLAGS if flag in cpu_flags]
    if units:
        return PrecisionPlan("mixed_bfloat16", f"the CPU has bfloat16 matrix units ({', '.join(units).upper()})")
    return PrecisionPlan("float32", "the CPU has no bfloat16 matrix units")


@functools.lru_cache(maxsize=None)
def cpu_flags(path: str = "/proc/cpuinfo") -> Tuple[str, ...]:
    """This machine's CPU feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return tuple(line.split(":", 1)[1].split())
    except OSError:
        pass
    return ()


def machine_precision(gpu_devices: Sequence[str] = ()) -> PrecisionPlan:
    """plan_precision of this machine: its CPU's flags, and the compute capability of each GPU in `gpu_devices`."""
    capabilities = []
    if gpu_devices:
        import tensorflow as tf

        physical = tf.config.list_physical_devices("GPU")
        for name in gpu_devices:
            index = int(name.rsplit(":", 1)[-1])
            details = tf.config.experimental.get_device_details(physical[index]) if index < len(physical) else {}
            capabilities.append(details.get("compute_capability"))
    return plan_precision(cpu_flags(), capabilities)
