"""`gpupar devices`: what TensorFlow sees, and which strategy and all-reduce auto would use.

`build_report` is a pure function of the device facts (tests call it with fake GPUs);
`collect_report` reads them from TensorFlow.
"""

import json

from gpupar.runtime.strategy import short_name

NO_GPU_HINT = (
    "no GPU found: training runs on the CPU. To try multi-device training here, split the CPU "
    "into virtual devices: gpupar devices --virtual_cpus=2, then gpupar --virtual_cpus=2"
)


def build_report(physical, logical, gpu_details, gpu_memory_mb, visible_gpus, plan, versions, ignored=()):
    """The report as plain data.

    physical/logical: (name, type) pairs; gpu_details: one dict per physical GPU with
    'device_name' and 'compute_capability' where TensorFlow knows them; gpu_memory_mb: one total
    per physical GPU or None; plan: the strategy Plan auto chose.
    """
    physical_gpus = [name for name, kind in physical if kind == "GPU"]
    physical_rows = []
    for name, kind in physical:
        row = {"name": name, "type": kind}
        if kind == "GPU":
            i = physical_gpus.index(name)
            details = gpu_details[i] if i < len(gpu_details) else {}
            capability = details.get("compute_capability")
            row.update(
                gpu_name=details.get("device_name"),
                compute_capability=".".join(map(str, capability)) if capability else None,
                memory_mb=gpu_memory_mb[i] if i < len(gpu_memory_mb) else None,
            )
        physical_rows.append(row)
    notes = list(ignored)
    if not physical_gpus:
        notes.append(NO_GPU_HINT)
    return {
        **versions,
        "physical_devices": physical_rows,
        "logical_devices": [{"name": name, "type": kind} for name, kind in logical],
        "visible_gpus": list(visible_gpus),
        "strategy": {
            "kind": plan.kind,
            "devices": list(plan.devices),
            "replicas": plan.num_replicas,
            "workers": plan.num_workers,
            "all_reduce": plan.cross_device_ops,
            "parameter_device": plan.parameter_device,
            "reason": plan.reason,
            "description": plan.describe(),
        },
        "notes": notes,
    }


def format_report(report) -> str:
    """The report as a few human-readable lines."""
    lines = [f"TensorFlow {report['tensorflow']}, Keras {report['keras']}, built with CUDA: {report['built_with_cuda']}"]
    lines.append("physical devices:")
    for row in report["physical_devices"]:
        extra = ""
        if row["type"] == "GPU":
            memory = f"{row['memory_mb']:,} MiB" if row["memory_mb"] else "memory unknown (install nvidia-ml-py)"
            extra = f"  {row['gpu_name'] or 'unknown GPU'}, compute capability {row['compute_capability'] or '?'}, {memory}"
        lines.append(f"  {row['name']}{extra}")
    lines.append("logical devices: " + ", ".join(short_name(d["name"]) for d in report["logical_devices"]))
    if report["visible_gpus"]:
        lines.append("visible GPUs: " + ",".join(map(str, report["visible_gpus"])))
    lines.append(report["strategy"]["description"])
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def collect_report(config) -> dict:
    """Configures the devices as `config` says (like training would) and reports them."""
    import keras
    import tensorflow as tf

    from gpupar.runtime.devices import configure_devices, gpu_memory
    from gpupar.runtime.strategy import detected_plan

    device_plan = configure_devices(config.device_setup)
    physical = [(d.name, d.device_type) for d in tf.config.list_physical_devices()]
    gpus = tf.config.list_physical_devices("GPU")
    details = [tf.config.experimental.get_device_details(g) for g in gpus]
    logical = [(d.name, d.device_type) for d in tf.config.list_logical_devices()]
    plan = detected_plan("auto", config.distribution.devices, config.distribution.cross_device_ops,
                         max_cpus=config.device_setup.virtual_cpus or 1)
    versions = {"tensorflow": tf.__version__, "keras": keras.__version__, "built_with_cuda": tf.test.is_built_with_cuda()}
    return build_report(physical, logical, details, gpu_memory(len(gpus))[0], device_plan.visible_gpus, plan,
                        versions, device_plan.ignored)


def to_json(report) -> str:
    """The report as indented JSON."""
    return json.dumps(report, indent=2)
