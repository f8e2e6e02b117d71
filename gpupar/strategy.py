"""Which tf.distribute strategy to use, and building it.

`plan_strategy` is a pure function of the device lists, so tests call it with fake GPUs;
`build_strategy` is the one place that calls TensorFlow.
"""

import dataclasses
import logging
import sys
from typing import Optional, Sequence, Tuple

from gpupar.config import CROSS_DEVICE_OPS, MODEL_PARALLEL, STRATEGIES
from gpupar.errors import GpuparError

log = logging.getLogger("gpupar")

_CLASS_NAMES = {
    "one_device": "OneDeviceStrategy",
    "mirrored": "MirroredStrategy",
    "central_storage": "CentralStorageStrategy",
}
_ALL_REDUCE_NAMES = {
    "nccl": "NcclAllReduce",
    "hierarchical_copy": "HierarchicalCopyAllReduce",
    "reduction_to_one_device": "ReductionToOneDevice",
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A strategy decision.

    Attributes:
      kind: one_device, mirrored or central_storage (never auto).
      devices: The compute devices, one replica each.
      cross_device_ops: The all-reduce for mirrored (a CROSS_DEVICE_OPS name), else None.
      parameter_device: Where central_storage keeps the variables, else None.
      reason: Why this plan, in a few words.
    """

    kind: str
    devices: Tuple[str, ...]
    cross_device_ops: Optional[str]
    parameter_device: Optional[str]
    reason: str

    @property
    def num_replicas(self) -> int:
        return len(self.devices)

    def describe(self) -> str:
        """One log line: strategy, devices, replicas and all-reduce."""
        if self.kind == "mirrored":
            reduce = _ALL_REDUCE_NAMES[self.cross_device_ops]
        elif self.kind == "central_storage":
            reduce = f"gradients reduced onto the variables on {self.parameter_device}"
        else:
            reduce = "none (one replica)"
        return (
            f"strategy: {_CLASS_NAMES[self.kind]} on {', '.join(self.devices)} "
            f"({self.num_replicas} replica{'s' if self.num_replicas > 1 else ''}); "
            f"all-reduce: {reduce}; {self.reason}"
        )


def short_name(device: str) -> str:
    """'/job:localhost/replica:0/task:0/device:GPU:1' or '/device:GPU:1' -> '/gpu:1'."""
    kind, index = device.rsplit("/", 1)[-1].replace("device:", "").split(":")
    return f"/{kind.lower()}:{index}"


def plan_strategy(
    kind: str,
    gpus: Sequence[str],
    cpus: Sequence[str],
    devices: Optional[Sequence[str]] = None,
    cross_device_ops: str = "auto",
    platform: str = sys.platform,
) -> Plan:
    """Chooses the strategy for the given logical GPUs and CPUs (or an explicit device list)."""
    if kind == MODEL_PARALLEL:
        raise GpuparError(
            "strategy=model_parallel is gpupar's own pipeline, not a tf.distribute strategy: train with "
            "gpupar.fit_mnist(strategy='model_parallel') or the gpupar command; gpupar.plan_stages plans it"
        )
    if kind not in STRATEGIES:
        raise GpuparError(f"strategy={kind!r} is unknown; choose one of: {', '.join(STRATEGIES)}")
    if cross_device_ops not in CROSS_DEVICE_OPS:
        raise GpuparError(
            f"cross_device_ops={cross_device_ops!r} is unknown; choose one of: "
            f"{', '.join(CROSS_DEVICE_OPS)}"
        )
    gpus = [short_name(d) for d in gpus]
    cpus = [short_name(d) for d in cpus]
    if devices:
        chosen = [short_name(d) for d in devices]
        missing = [d for d in chosen if d not in gpus + cpus]
        if missing:
            raise GpuparError(
                f"device {missing[0]} does not exist here; available: {', '.join(gpus + cpus)}"
            )
        if len(set(chosen)) != len(chosen):
            raise GpuparError(f"devices={','.join(chosen)} names a device twice")
        source = "devices given"
    elif gpus:
        chosen, source = gpus, f"{len(gpus)} GPU(s) found"
    else:
        chosen = cpus
        source = f"no GPU found, {len(cpus)} virtual CPUs" if len(cpus) > 1 else "no GPU found"

    if kind == "auto":
        kind = "mirrored" if len(chosen) > 1 else "one_device"
        reason = f"auto: {source}"
    else:
        reason = f"asked for {kind}: {source}"

    if kind == "one_device":
        if not devices:
            chosen = chosen[:1]
        if len(chosen) != 1:
            raise GpuparError(
                f"strategy=one_device runs on one device, but {len(chosen)} were given "
                f"({', '.join(chosen)}); choose one of: {', '.join(STRATEGIES)}, or pass one device"
            )
        return Plan("one_device", tuple(chosen), None, None, reason)
    if kind == "mirrored":
        if len(chosen) < 2:
            raise GpuparError(
                f"strategy=mirrored needs at least 2 devices, but only {', '.join(chosen)} is "
                f"available; use strategy=one_device, or virtual_cpus=2 for a CPU-only test. "
                f"Choices: {', '.join(STRATEGIES)}"
            )
        return Plan("mirrored", tuple(chosen), _choose_all_reduce(cross_device_ops, chosen, platform), None, reason)
    return Plan("central_storage", tuple(chosen), None, "/cpu:0", reason)


def _choose_all_reduce(requested, devices, platform):
    all_gpu = all(d.startswith("/gpu:") for d in devices)
    if requested == "auto":
        if not all_gpu:
            return "reduction_to_one_device"
        # TensorFlow's Linux GPU builds ship NCCL; elsewhere hierarchical copy is the safe choice.
        return "nccl" if platform.startswith("linux") else "hierarchical_copy"
    if requested in ("nccl", "hierarchical_copy") and not all_gpu:
        raise GpuparError(
            f"cross_device_ops={requested} all-reduces between GPUs, but the devices are "
            f"{', '.join(devices)}; use reduction_to_one_device (or auto) on CPUs"
        )
    return requested


def build_strategy(plan: Plan):
    """Creates the tf.distribute.Strategy a Plan describes."""
    import tensorflow as tf

    if plan.kind == "one_device":
        return tf.distribute.OneDeviceStrategy(plan.devices[0])
    if plan.kind == "central_storage":
        return tf.distribute.experimental.CentralStorageStrategy(
            list(plan.devices), parameter_device=plan.parameter_device
        )
    all_reduce = {
        "nccl": tf.distribute.NcclAllReduce,
        "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
        "reduction_to_one_device": tf.distribute.ReductionToOneDevice,
    }[plan.cross_device_ops]()
    return tf.distribute.MirroredStrategy(list(plan.devices), cross_device_ops=all_reduce)


def detected_plan(kind="auto", devices=None, cross_device_ops="auto", max_cpus=None) -> Plan:
    """Plans from TensorFlow's logical devices; `max_cpus` keeps only the first CPUs."""
    import tensorflow as tf

    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    if max_cpus is not None:
        cpus = cpus[:max_cpus]
    return plan_strategy(kind, gpus, cpus, devices=devices, cross_device_ops=cross_device_ops)


def make_strategy(kind="auto", devices=None, cross_device_ops="auto"):
    """Returns the tf.distribute.Strategy for this machine's devices, and logs the choice."""
    plan = detected_plan(kind, devices, cross_device_ops)
    log.info(plan.describe())
    return build_strategy(plan)
