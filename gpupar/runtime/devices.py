"""TensorFlow runtime set-up: visible GPUs, GPU memory, placement, virtual CPUs and thread pools.

`plan_devices` decides from a device list alone (tests call it with fake GPUs);
`configure_devices` is the one place that tells TensorFlow.
"""

import dataclasses
import logging
import os
from typing import Mapping, Optional, Sequence, Tuple

from gpupar.errors import GpuparError, TensorFlowStarted
from gpupar.runtime.nvml import installed_nvml, match_visible, read_gpus

log = logging.getLogger("gpupar")


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """What to tell the runtime.

    Attributes:
      visible_gpus: Indices of the physical GPUs to keep visible.
      memory_growth: Turn on memory growth for every visible GPU.
      memory_limits_mb: One memory cap (MiB) per visible GPU, or None for no cap.
      virtual_cpus: Logical CPU devices to create, or None to leave one.
      soft_placement: Value for tf.config.set_soft_device_placement.
      log_placement: Value for tf.debugging.set_log_device_placement.
      intra_op_threads: Threads one op may use (0: TensorFlow's default, the number of cores).
      inter_op_threads: Ops that may run at once (0: TensorFlow's default, the number of cores).
      ignored: One message per requested setting that has no effect here (or less than asked), and why.
      environment: Variables to set before TensorFlow makes its devices (TF_FORCE_GPU_ALLOW_GROWTH).
    """

    visible_gpus: Tuple[int, ...]
    memory_growth: bool
    memory_limits_mb: Optional[Tuple[int, ...]]
    virtual_cpus: Optional[int]
    soft_placement: bool
    log_placement: bool
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    ignored: Tuple[str, ...] = ()
    environment: Mapping[str, str] = dataclasses.field(default_factory=dict)


def plan_devices(
    num_gpus: int,
    gpus: Optional[Sequence[int]] = None,
    memory_growth: bool = False,
    memory_limit_mb: Optional[int] = None,
    memory_fraction: Optional[float] = None,
    virtual_cpus: Optional[int] = None,
    soft_placement: bool = True,
    log_placement: bool = False,
    gpu_memory_mb: Optional[Sequence[Optional[int]]] = None,
    gpu_free_mb: Optional[Sequence[Optional[int]]] = None,
    cores: int = 1,
    intra_op_threads: Optional[int] = None,
    inter_op_threads: Optional[int] = None,
) -> DevicePlan:
    """Decides the runtime settings for a machine with `num_gpus` physical GPUs and `cores` CPU cores.

    Args:
      num_gpus: Physical GPUs on the machine (fake counts in tests).
      gpus: GPU indices to keep visible; None for all.
      memory_growth, memory_limit_mb, memory_fraction: GPU memory, as the Config fields say.
      virtual_cpus: Logical CPU devices to make, or None.
      soft_placement, log_placement: As the Config fields say.
      gpu_memory_mb: Each physical GPU's total memory (None where unknown); only memory_fraction needs it.
      gpu_free_mb: Each physical GPU's memory not in use (None where unknown): a fraction is capped at it.
      cores: CPU cores this process may use.
      intra_op_threads, inter_op_threads: Thread counts; None lets plan_threads choose.

    Returns:
      The DevicePlan, with a message for each setting that has no effect here.

    Raises:
      GpuparError: a GPU index that does not exist, or a fraction of a GPU whose size is unknown.
    """
    ignored = []
    intra, inter = plan_threads(cores, num_gpus, virtual_cpus, intra_op_threads, inter_op_threads)
    if num_gpus == 0:
        requested = [
            ("gpus", gpus is not None),
            ("memory_growth", memory_growth),
            ("memory_limit_mb", memory_limit_mb is not None),
            ("memory_fraction", memory_fraction is not None),
        ]
        ignored = [f"{name} ignored: this machine has no GPU" for name, on in requested if on]
        return DevicePlan((), False, None, virtual_cpus, soft_placement, log_placement, intra, inter, tuple(ignored))

    visible = tuple(range(num_gpus)) if gpus is None else tuple(gpus)
    missing = [i for i in visible if not 0 <= i < num_gpus]
    if missing:
        raise GpuparError(
            f"gpus={','.join(map(str, visible))}: no GPU with index {missing[0]}; this machine has "
            f"{num_gpus} GPU(s), indices 0..{num_gpus - 1}"
        )
    if not visible:
        raise GpuparError("gpus is empty; name at least one GPU index, e.g. gpus='0'")

    limits = None
    if memory_limit_mb is not None:
        limits = tuple(memory_limit_mb for _ in visible)
    elif memory_fraction is not None:
        limits = tuple(_fraction_limit(i, memory_fraction, gpu_memory_mb, gpu_free_mb, ignored) for i in visible)
    if limits is not None and memory_growth:
        ignored.append("memory_growth ignored: a memory limit is set, and TensorFlow allows only one")
        memory_growth = False
    # Once any logical device configuration exists (the virtual CPUs), TensorFlow ignores
    # set_memory_growth, while get_memory_growth() still says True; this variable holds either way.
    environment = {"TF_FORCE_GPU_ALLOW_GROWTH": "true"} if memory_growth else {}
    return DevicePlan(visible, memory_growth, limits, virtual_cpus, soft_placement, log_placement, intra, inter,
                      tuple(ignored), environment)


def plan_threads(cores: int, num_gpus: int, virtual_cpus: Optional[int], intra: Optional[int] = None,
                 inter: Optional[int] = None) -> Tuple[int, int]:
    """(intra-op, inter-op) thread counts; 0 leaves one to TensorFlow, a given count is kept.

    Replicas on N virtual CPUs share one machine's cores, and TensorFlow gives every op all the
    cores: N replicas' ops then queue behind each other, each barely using its threads (the
    ConvNet's small convolutions). Like the classic one-tower-per-core code, gpupar gives each
    op its share of the cores and lets the N replicas' ops run at once. Elsewhere (one CPU
    device, or GPUs doing the work) TensorFlow's defaults stay.
    """
    if num_gpus == 0 and virtual_cpus is not None and virtual_cpus > 1:
        chosen_intra, chosen_inter = max(1, cores // virtual_cpus), max(virtual_cpus, cores)
    else:
        chosen_intra, chosen_inter = 0, 0
    return (chosen_intra if intra is None else intra), (chosen_inter if inter is None else inter)


def _fraction_limit(index, fraction, gpu_memory_mb, gpu_free_mb, notes):
    total = None if gpu_memory_mb is None or index >= len(gpu_memory_mb) else gpu_memory_mb[index]
    if total is None:
        raise GpuparError(
            f"memory_fraction needs the total memory of GPU {index}, which could not be read; "
            "install nvidia-ml-py (pip install 'gpupar[nvml]'), set CUDA_DEVICE_ORDER=PCI_BUS_ID if you changed it, "
            "or use memory_limit_mb instead"
        )
    limit = max(1, int(total * fraction))
    free = None if gpu_free_mb is None or index >= len(gpu_free_mb) else gpu_free_mb[index]
    if free is not None and limit > free:
        notes.append(f"memory_fraction={fraction} of GPU {index} is {limit:,} MiB, more than the {free:,} MiB free "
                     f"(other processes use the rest): capped at {free:,} MiB")
        limit = max(1, free)
    return limit


def gpu_memory(num_gpus: int, environ=None) -> Tuple[Tuple[Optional[int], ...], Tuple[Optional[int], ...]]:
    """(total, free) MiB of each of TensorFlow's physical GPUs, from NVML, None where it cannot tell.

    TensorFlow's GPUs are matched to NVML's through CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER
    (gpupar.runtime.nvml.match_visible): TensorFlow has not started its devices yet.
    """
    environ = os.environ if environ is None else environ
    nvml_module = installed_nvml()
    gpus = read_gpus(nvml_module) if nvml_module else []
    matched = match_visible(num_gpus, gpus, environ.get("CUDA_VISIBLE_DEVICES"), environ.get("CUDA_DEVICE_ORDER"))
    return tuple(g.total_mb if g else None for g in matched), tuple(g.free_mb if g else None for g in matched)


def configure_devices(config=None, **options) -> DevicePlan:
    """Applies the device options to TensorFlow: the one call at the top of a script, before any other TF work.

        gpupar.configure_devices(virtual_cpus=2)        # or memory_growth=True, gpus="0,1", ...

    Everything after it may make datasets, adapt() layers or optimizers; gpupar.fit, given the
    same device options, finds the devices set up. If TensorFlow has already set up its devices, a
    request it can still honour (the same or fewer virtual CPUs, no GPU change) is accepted.

    Args:
      config: A gpupar.config.DeviceSetup, or a gpupar.Config (its device_setup is read); None:
        the options.
      **options: DeviceSetup fields (gpus, memory_growth, memory_limit_mb, memory_fraction,
        soft_placement, log_placement, virtual_cpus, intra_op_threads, inter_op_threads).

    Returns:
      The DevicePlan that was applied.

    Raises:
      GpuparError: as plan_devices, or a change TensorFlow, already started, can no longer make.
    """
    import tensorflow as tf

    from gpupar.config import Config

    config = getattr(config, "device_setup", config) if config is not None else Config(**options).device_setup

    physical_gpus = tf.config.list_physical_devices("GPU")
    totals, free = gpu_memory(len(physical_gpus)) if config.memory_fraction is not None else (None, None)
    plan = plan_devices(
        len(physical_gpus),
        gpus=config.gpus,
        memory_growth=config.memory_growth,
        memory_limit_mb=config.memory_limit_mb,
        memory_fraction=config.memory_fraction,
        virtual_cpus=config.virtual_cpus,
        soft_placement=config.soft_placement,
        log_placement=config.log_placement,
        gpu_memory_mb=totals,
        gpu_free_mb=free,
        cores=len(os.sched_getaffinity(0)),
        intra_op_threads=config.intra_op_threads,
        inter_op_threads=config.inter_op_threads,
    )
    for message in plan.ignored:
        log.info(message)
    os.environ.update(plan.environment)  # read when TensorFlow makes its GPU devices, after this
    tf.config.set_soft_device_placement(plan.soft_placement)
    tf.debugging.set_log_device_placement(plan.log_placement)
    _apply_threads(tf, plan)
    try:
        _apply_runtime_settings(tf, plan, physical_gpus)
    except RuntimeError as e:
        _accept_initialised_runtime(tf, plan, physical_gpus, e)
    return plan


def _apply_threads(tf, plan):
    """Sets the thread pools; once TensorFlow has started they are fixed, which is then logged."""
    wanted = (plan.intra_op_threads, plan.inter_op_threads)
    current = (tf.config.threading.get_intra_op_parallelism_threads(),
               tf.config.threading.get_inter_op_parallelism_threads())
    if wanted == current:
        return
    try:
        tf.config.threading.set_intra_op_parallelism_threads(plan.intra_op_threads)
        tf.config.threading.set_inter_op_parallelism_threads(plan.inter_op_threads)
    except RuntimeError:
        log.info("TensorFlow had already started with %s intra-op and %s inter-op threads; keeping them",
                 *(n or "default" for n in current))


def _apply_runtime_settings(tf, plan, physical_gpus):
    if physical_gpus:
        visible = [physical_gpus[i] for i in plan.visible_gpus]
        tf.config.set_visible_devices(visible, "GPU")
        for i, gpu in enumerate(visible):
            if plan.memory_growth:
                tf.config.experimental.set_memory_growth(gpu, True)
            if plan.memory_limits_mb is not None:
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=plan.memory_limits_mb[i])]
                )
    if plan.virtual_cpus is not None:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(plan.virtual_cpus)]
        )


def _accept_initialised_runtime(tf, plan, physical_gpus, error):
    logical_cpus = len(tf.config.list_logical_devices("CPU"))
    gpu_change = bool(physical_gpus) and (
        plan.memory_growth
        or plan.memory_limits_mb is not None
        or len(plan.visible_gpus) != len(tf.config.list_logical_devices("GPU"))
    )
    if gpu_change or (plan.virtual_cpus or 1) > logical_cpus:
        raise TensorFlowStarted(
            "TensorFlow has already initialised its devices, so the device settings can no longer "
            f"change (TensorFlow said: {error}): something ran TensorFlow first (a dataset, adapt(), a metric "
            "or optimizer object). Call gpupar.configure_devices(...) with the device options first thing in "
            "the script, or start a fresh process."
        ) from None
    log.info(
        "TensorFlow's devices were already initialised with %d logical CPU(s); using %d of them",
        logical_cpus,
        plan.virtual_cpus or 1,
    )
