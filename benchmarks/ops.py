"""Op time by kind in a TensorBoard profile: where a benchmarked step spends its time."""

import collections
import glob
import os
import re
from typing import Dict

# Kinds of work in a profile, matched against TensorFlow op types (first match wins).
_OP_KINDS = (
    ("all-reduce", ("Collective", "Nccl")),
    ("copies between devices", ("_Send", "_Recv")),
    ("convolution", ("Conv2D",)),
    ("pooling", ("MaxPool", "AvgPool")),
    ("dense (matmul)", ("MatMul",)),
)
_XLA_EVENTS = ("CpuExecutable::ExecuteAsyncOnStream", "GpuExecutable::ExecuteAsyncOnStream")
_TF_OP = re.compile(r"^[^ :]+:(\w+)$")  # "scope/name:OpType"; runtime events have spaces or "::"


def op_seconds(log_dir: str) -> Dict[str, float]:
    """Seconds of op time by kind in the newest profile under log_dir, summed over threads.

    Kinds: all-reduce (collectives, waiting for the other replicas included, or the sums of
    ReductionToOneDevice: AddN inside the optimizer), copies between devices, convolution,
    pooling, dense (matmul), XLA kernels (the batch norm), other ops, and the input pipeline
    (tf.data's own threads, which run beside the step rather than inside it).
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"no profile (*.xplane.pb) under {log_dir}")
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    seconds = collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                kind = _kind(line.name, name)
                if kind:
                    seconds[kind] += event.duration_ps * 1e-12
    return dict(seconds)


def _kind(line: str, event: str):
    if event in _XLA_EVENTS:
        return "XLA kernels (batch norm)"
    match = _TF_OP.match(event)
    if match is None:
        return None
    if line.startswith("tf_data"):
        return "input pipeline (beside the step)"
    op_type = match.group(1)
    if op_type == "AddN" and "/adam/" in event:  # ReductionToOneDevice sums the replicas' gradients so
        return "all-reduce"
    for kind, parts in _OP_KINDS:
        if any(part in op_type for part in parts):
            return kind
    return "other ops"
