"""`gpupar devices --check`: does this machine's GPU set-up work, checked in under a minute before a long job.

    gpupar devices --check [--memory_growth] [--cross_device_ops=nccl] [--json]

Each check prints PASS, FAIL (with the fix) or NOT RUN (with why): the GPUs TensorFlow and NVML
see, matched by PCI bus id; that the memory settings take effect; one all-reduce over every
device with the chosen cross-device ops; one XLA batch-norm compile; 20 mixed_float16 steps of
the ConvNet, whose loss must fall with a loss scale that holds. Without a GPU the CPU checks run
(the all-reduce over the virtual CPUs, XLA, the steps) and the GPU checks are listed as not run.
`plan_checks` is the pure decision of what can run.
"""

import dataclasses
import json
import time
from typing import Callable, List

PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
GPU_CHECKS = ("GPUs matched to NVML", "memory settings take effect")
CHECKS = (*GPU_CHECKS, "all-reduce", "XLA batch norm", "mixed_float16 steps")
GROWTH_SLACK_MB = 2048  # with memory growth, a small op must leave most of the GPU unclaimed


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


def plan_checks(num_gpus: int, nvml_installed: bool, memory_setting: bool) -> dict:
    """{check name: None to run it, or why it does not run}, from the machine's facts alone."""
    reasons = {name: None for name in CHECKS}
    if num_gpus == 0:
        for name in GPU_CHECKS:
            reasons[name] = "no GPU on this machine"
    elif not nvml_installed:
        reasons["GPUs matched to NVML"] = "nvidia-ml-py is not installed: pip install 'gpupar[nvml]'"
    if num_gpus and not memory_setting:
        reasons["memory settings take effect"] = "no memory setting given (--memory_growth, --memory_limit_mb)"
    return reasons


def _match(context) -> Check:
    from gpupar.runtime.nvml import installed_nvml, match_by_bus_id, read_gpus, tf_bus_ids

    bus_ids = tf_bus_ids()
    matched = match_by_bus_id(bus_ids, read_gpus(installed_nvml()))
    lines = [f"GPU:{i} {bus} -> {'NVML ' + str(g.index) + ' ' + g.name + (' (MIG)' if g.mig else '') if g else 'none'}"
             for i, (bus, g) in enumerate(zip(bus_ids, matched))]
    if all(matched):
        return Check(GPU_CHECKS[0], PASS, "; ".join(lines))
    return Check(GPU_CHECKS[0], FAIL, "; ".join(lines), "a GPU TensorFlow uses has no NVML device at its PCI bus id: "
                 "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")


def _memory(context) -> Check:
    import tensorflow as tf

    from gpupar.runtime.nvml import installed_nvml, match_by_bus_id, read_gpus, tf_bus_ids

    with tf.device("/gpu:0"):
        float(tf.reduce_sum(tf.ones([256, 256])))
    config, name = context["config"], GPU_CHECKS[1]
    gpu = match_by_bus_id(tf_bus_ids()[:1], read_gpus(installed_nvml()))[0] if installed_nvml() else None
    if config.memory_limit_mb is not None or config.memory_fraction is not None:
        limit = tf.config.get_logical_device_configuration(tf.config.list_physical_devices("GPU")[0])
        ok = bool(limit) and limit[0].memory_limit is not None
        return Check(name, PASS if ok else FAIL, f"logical GPU:0 limit {limit[0].memory_limit if limit else 'none'} MiB",
                     "" if ok else "the limit did not reach TensorFlow: set it before any other TensorFlow work")
    if gpu is None:
        return Check(name, NOT_RUN, "", "NVML cannot tell the memory in use: pip install 'gpupar[nvml]'")
    used = gpu.total_mb - gpu.free_mb
    ok = used < GROWTH_SLACK_MB
    return Check(name, PASS if ok else FAIL, f"{used:,} of {gpu.total_mb:,} MiB in use after a small op",
                 "" if ok else "memory growth did not hold: TensorFlow mapped the GPU at start; set "
                 "TF_FORCE_GPU_ALLOW_GROWTH=true before TensorFlow starts (gpupar does with --memory_growth)")


def _all_reduce(context) -> Check:
    import tensorflow as tf

    from gpupar.runtime.strategy import build_strategy

    plan = context["plan"]
    strategy = build_strategy(plan)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(float(ctx.replica_id_in_sync_group + 1)))
    total = float(strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None))
    expected = plan.num_replicas * (plan.num_replicas + 1) / 2
    detail = f"{plan.describe().split(';')[0]}, all-reduce {plan.cross_device_ops or 'none'}: sum {total:g}"
    if total == expected:
        return Check("all-reduce", PASS, detail)
    return Check("all-reduce", FAIL, f"{detail}, expected {expected:g}", "try --cross_device_ops=reduction_to_one_device "
                 "(NCCL needs a working driver, and hierarchical_copy an even number of GPUs)")


def _xla(context) -> Check:
    from gpupar.models.layers import xla_batch_norm_error

    device = context["plan"].devices[0]
    error = xla_batch_norm_error(device)
    if error is None:
        return Check("XLA batch norm", PASS, f"compiled on {device}")
    return Check("XLA batch norm", FAIL, error, "CUDA's ptxas and libdevice are missing: pip install "
                 "'tensorflow[and-cuda]' (gpupar falls back to Keras' batch norm meanwhile, slower)")


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
    scale = float(optimizer.dynamic_scale.numpy())
    detail = f"on {device}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, loss scale {scale:g}"
    if np.isfinite(losses).all() and losses[-1] < losses[0] and scale >= 1:
        return Check("mixed_float16 steps", PASS, detail)
    return Check("mixed_float16 steps", FAIL, detail, "mixed_float16 does not train here: use precision=float32 (or "
                 "mixed_bfloat16 on CPUs with bfloat16 units)")


_RUN: dict = {GPU_CHECKS[0]: _match, GPU_CHECKS[1]: _memory, "all-reduce": _all_reduce, "XLA batch norm": _xla,
              "mixed_float16 steps": _mixed_steps}


def run_checks(config) -> List[Check]:
    """Configures the devices as config says and runs every check that can run here."""
    import tensorflow as tf

    from gpupar.runtime.devices import configure_devices
    from gpupar.runtime.nvml import installed_nvml
    from gpupar.runtime.strategy import detected_plan

    configure_devices(config)
    gpus = tf.config.list_physical_devices("GPU")
    memory_setting = config.memory_growth or config.memory_limit_mb is not None or config.memory_fraction is not None
    reasons = plan_checks(len(gpus), installed_nvml() is not None, memory_setting)
    context = {"config": config,
               "plan": detected_plan("auto", config.devices, config.cross_device_ops, max_cpus=config.virtual_cpus or 1)}
    results = []
    for name in CHECKS:
        if reasons[name] is not None:
            results.append(Check(name, NOT_RUN, "", reasons[name]))
            continue
        results.append(_guarded(name, _RUN[name], context))
    return results


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
