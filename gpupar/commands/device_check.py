"""`gpupar devices --check`: does this machine's GPU set-up work, checked in under a minute before a long job.

    gpupar devices --check [--memory_growth] [--cross_device_ops=nccl] [--json]

Each check prints PASS, FAIL (with the fix) or NOT RUN (with why): the GPUs TensorFlow and NVML
see, matched by PCI bus id; that the memory settings take effect; one all-reduce over every
device with the chosen cross-device ops; one XLA batch-norm compile; 20 mixed_float16 steps of
the ConvNet, whose loss must fall with a loss scale that holds. Without a GPU the CPU checks run
(the all-reduce over the virtual CPUs, XLA, the steps) and the GPU checks are listed as not run.
`plan_checks` decides what can run; each check reads TensorFlow or NVML in a few lines and hands
what it read to a pure `judge_*` function, which tests call with fake devices and readings.
"""

import dataclasses
import json
import math
import time
from typing import Callable, List, Optional, Sequence

from gpupar.runtime.nvml import NvmlGpu, installed_nvml, match_by_bus_id, read_gpus, tf_bus_ids

PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
MATCH, MEMORY, ALL_REDUCE, XLA, MIXED = (
    "GPUs matched to NVML", "memory settings take effect", "all-reduce", "XLA batch norm", "mixed_float16 steps")
GPU_CHECKS = (MATCH, MEMORY)
CHECKS = (*GPU_CHECKS, ALL_REDUCE, XLA, MIXED)
SLACK_MB = 2048  # CUDA's context and a small op: what a GPU may lose beyond its limit (nothing, with growth)
NO_NVML = "nvidia-ml-py is not installed: pip install 'gpupar[nvml]'"


@dataclasses.dataclass(frozen=True)
class Check:
    """One check's outcome.

    Attributes:
      name: What was checked.
      status: PASS, FAIL or NOT RUN.
      detail: What was seen.
      fix: What to do about a failure (or why it did not run).
    """

    name: str
    status: str
    detail: str = ""
    fix: str = ""


def plan_checks(num_gpus: int, nvml_installed: bool, memory_setting: bool, nvml_gpus: int = 0) -> dict:
    """{check name: None to run it, or why it does not run}, from the machine's facts alone.

    The match also runs where NVML sees GPUs (`nvml_gpus`) and TensorFlow none, to fail with the fix.
    The memory check needs NVML, which tells the memory in use.
    """
    reasons = dict.fromkeys(CHECKS)
    if num_gpus == 0:
        reasons[MEMORY] = "TensorFlow sees no GPU" if nvml_gpus else "no GPU on this machine"
        if not nvml_gpus:
            reasons[MATCH] = "no GPU on this machine"
    elif not memory_setting:
        reasons[MEMORY] = "no memory setting given (--memory_growth, --memory_limit_mb)"
    if not nvml_installed:
        for name in GPU_CHECKS:
            reasons[name] = reasons[name] or NO_NVML
    return reasons


def judge_match(bus_ids: Sequence[Optional[str]], gpus: Sequence[NvmlGpu]) -> Check:
    """PASS where each of TensorFlow's GPUs (by PCI bus id, in TensorFlow's order) has its NVML device; MIG said."""
    if not bus_ids:
        return Check(MATCH, FAIL, f"TensorFlow made no GPU device; NVML sees {len(gpus)} GPU(s)",
                     "TensorFlow cannot use these GPUs: pip install 'tensorflow[and-cuda]' (CUDA's libraries), and "
                     "see TensorFlow's log for a compute capability it does not support")
    matched = match_by_bus_id(bus_ids, gpus)
    detail = "; ".join(f"GPU:{i} {bus} -> {_describe(g)}" for i, (bus, g) in enumerate(zip(bus_ids, matched)))
    if all(matched):
        return Check(MATCH, PASS, detail)
    return Check(MATCH, FAIL, detail, "a GPU TensorFlow uses has no NVML device at its PCI bus id: check the driver "
                 "(nvidia-smi) and CUDA_VISIBLE_DEVICES")


def _describe(gpu: Optional[NvmlGpu]) -> str:
    if gpu is None:
        return "none"
    return f"NVML {gpu.index} {gpu.name}" + (" (MIG: NVML reports no utilisation)" if gpu.mig else "")


def memory_taken_mb(bus_ids: Sequence[Optional[str]], before: Sequence[NvmlGpu],
                    after: Sequence[NvmlGpu]) -> List[Optional[int]]:
    """MiB of free memory each of TensorFlow's GPUs lost between two NVML readings; None where one lacks the GPU."""
    return [b.free_mb - a.free_mb if a and b and None not in (a.free_mb, b.free_mb) else None
            for b, a in zip(match_by_bus_id(bus_ids, before), match_by_bus_id(bus_ids, after))]


def judge_memory(taken_mb: Sequence[Optional[int]], limits_mb: Optional[Sequence[int]]) -> Check:
    """PASS where no GPU lost more than its limit (with memory growth: nothing) plus SLACK_MB after a small op.

    Args:
      taken_mb: What each of TensorFlow's GPUs lost since before TensorFlow started (None where unknown).
      limits_mb: Each GPU's memory limit; None with memory growth.
    """
    if all(t is None for t in taken_mb):
        return Check(MEMORY, NOT_RUN, "", "NVML did not report the memory of TensorFlow's GPUs (see the match)")
    allowed = [SLACK_MB + (limits_mb[i] if limits_mb else 0) for i in range(len(taken_mb))]
    detail = "; ".join(f"GPU:{i} " + ("not in NVML's readings" if t is None else
                                      f"{t:,} MiB taken after a small op (at most {a:,})")
                       for i, (t, a) in enumerate(zip(taken_mb, allowed)))
    if all(t is None or t <= a for t, a in zip(taken_mb, allowed)):
        return Check(MEMORY, PASS, detail)
    if limits_mb:
        fix = ("the memory limit did not hold: set it before any other TensorFlow work, and check that no other "
               "process took this GPU's memory meanwhile (nvidia-smi)")
    else:
        fix = ("memory growth did not hold: TensorFlow mapped the GPU at start; set TF_FORCE_GPU_ALLOW_GROWTH=true "
               "before TensorFlow starts (gpupar does with --memory_growth)")
    return Check(MEMORY, FAIL, detail, fix)


def judge_all_reduce(plan, total: float) -> Check:
    """PASS where the all-reduce of each replica's index + 1 over plan's replicas summed to n(n+1)/2."""
    expected = plan.num_replicas * (plan.num_replicas + 1) / 2
    detail = f"{plan.describe().split(';')[0]}, all-reduce {plan.cross_device_ops or 'none'}: sum {total:g}"
    if total == expected:
        return Check(ALL_REDUCE, PASS, detail)
    return Check(ALL_REDUCE, FAIL, f"{detail}, expected {expected:g}", "try --cross_device_ops=reduction_to_one_device "
                 "(NCCL needs a working driver, and hierarchical_copy an even number of GPUs)")


def judge_xla(device: str, error: Optional[str]) -> Check:
    """PASS where the XLA batch norm compiled on device (error None); the fix depends on the device."""
    if error is None:
        return Check(XLA, PASS, f"compiled on {device}")
    if "gpu" in device.lower():
        fix = ("CUDA's ptxas and libdevice are missing: pip install 'tensorflow[and-cuda]' (gpupar falls back to "
               "Keras' batch norm meanwhile, slower)")
    else:
        fix = "XLA cannot compile on this CPU, and gpupar falls back to Keras' batch norm only on GPUs: see the error"
    return Check(XLA, FAIL, error, fix)


def judge_mixed_steps(device: str, losses: Sequence[float], scale: float) -> Check:
    """PASS where mixed_float16 training on device kept its losses finite, the last below the first, and a scale >= 1."""
    detail = f"on {device}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, loss scale {scale:g}"
    if all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] and scale >= 1:
        return Check(MIXED, PASS, detail)
    return Check(MIXED, FAIL, detail, "mixed_float16 does not train here: use precision=float32 (or mixed_bfloat16 "
                 "on CPUs with bfloat16 units)")


def _match(context) -> Check:
    return judge_match(tf_bus_ids(), read_gpus(context["nvml"]))


def _memory(context) -> Check:
    import tensorflow as tf

    for device in tf.config.list_logical_devices("GPU"):
        with tf.device(device.name):
            float(tf.reduce_sum(tf.ones([256, 256])))
    taken = memory_taken_mb(tf_bus_ids(), context["before"], read_gpus(context["nvml"]))
    return judge_memory(taken, context["devices"].memory_limits_mb)


def _all_reduce(context) -> Check:
    import tensorflow as tf

    from gpupar.runtime.strategy import build_strategy

    strategy = build_strategy(context["plan"])
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(float(ctx.replica_id_in_sync_group + 1)))
    return judge_all_reduce(context["plan"], float(strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None)))


def _xla(context) -> Check:
    from gpupar.models.layers import xla_batch_norm_error

    device = context["plan"].devices[0]
    return judge_xla(device, xla_batch_norm_error(device))


def _mixed_steps(context, steps: int = 20) -> Check:
    import keras
    import numpy as np
    import tensorflow as tf

    from gpupar.models.convnet import build_convnet

    device = context["plan"].devices[0]
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 64)
    images = (rng.random((64, 28, 28, 1)) * 0.1 + labels[:, None, None, None] / 10.0).astype("float32")
    with tf.device(device):
        model = build_convnet(0.0, dtype="mixed_float16")
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
        optimizer.build(model.trainable_variables)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                logits = tf.cast(model(images, training=True), tf.float32)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
                scaled = optimizer.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss

        losses = [float(step()) for _ in range(steps)]
    return judge_mixed_steps(device, losses, float(optimizer.dynamic_scale.numpy()))


_RUN: dict = {MATCH: _match, MEMORY: _memory, ALL_REDUCE: _all_reduce, XLA: _xla, MIXED: _mixed_steps}


def run_checks(config) -> List[Check]:
    """Configures the devices as config says and runs every check that can run here.

    NVML is read first, before TensorFlow maps any GPU memory: the memory check's baseline.
    """
    import tensorflow as tf

    from gpupar.runtime.devices import configure_devices
    from gpupar.runtime.strategy import detected_plan

    nvml = installed_nvml()
    before = read_gpus(nvml) if nvml else []
    devices = configure_devices(config.device_setup)
    memory_setting = devices.memory_growth or devices.memory_limits_mb is not None
    reasons = plan_checks(len(tf.config.list_physical_devices("GPU")), nvml is not None, memory_setting, len(before))
    context = {"nvml": nvml, "before": before, "devices": devices,
               "plan": detected_plan("auto", config.distribution.devices, config.distribution.cross_device_ops,
                         max_cpus=config.device_setup.virtual_cpus or 1)}
    return [_guarded(name, _RUN[name], context) if reasons[name] is None else Check(name, NOT_RUN, "", reasons[name])
            for name in CHECKS]


def _guarded(name: str, check: Callable, context) -> Check:
    started = time.perf_counter()
    try:
        result = check(context)
    except Exception as e:  # a check that crashes has failed; the others still run
        result = Check(name, FAIL, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                       "see the error; gpupar devices (without --check) shows what TensorFlow sees")
    return dataclasses.replace(result, detail=f"{result.detail} ({time.perf_counter() - started:.1f} s)".strip())


def format_checks(results: List[Check]) -> str:
    """One line per check, then its fix where it failed or did not run."""
    lines = []
    for c in results:
        lines.append(f"{c.status:<8} {c.name}" + (f": {c.detail}" if c.detail else ""))
        if c.fix:
            lines.append(f"         {'fix' if c.status == FAIL else 'why'}: {c.fix}")
    return "\n".join(lines)


def to_json(results: List[Check]) -> str:
    """The checks as JSON, for machines."""
    return json.dumps([dataclasses.asdict(c) for c in results], indent=2)
