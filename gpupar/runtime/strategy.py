"""Which tf.distribute strategy to use, and building it.

`plan_strategy` is a pure function of the device lists, so tests call it with fake GPUs;
`build_strategy` is the one place that calls TensorFlow.
"""

import dataclasses
import logging
import sys
from typing import Optional, Sequence, Tuple

from gpupar.runtime.cluster import Cluster
from gpupar.config import CROSS_DEVICE_OPS, STRATEGIES, STRATEGY_CHOICES
from gpupar.errors import GpuparError, TensorFlowStarted
from gpupar.runtime.network import warn_if_reachable

log = logging.getLogger("gpupar")

_CLASS_NAMES = {
    "one_device": "OneDeviceStrategy",
    "mirrored": "MirroredStrategy",
    "central_storage": "CentralStorageStrategy",
    "multi_worker_mirrored": "MultiWorkerMirroredStrategy",
    "parameter_server": "ParameterServerStrategy",
}
CLUSTER_KINDS = ("multi_worker_mirrored", "parameter_server")
_ALL_REDUCE_NAMES = {
    "nccl": "NcclAllReduce",
    "hierarchical_copy": "HierarchicalCopyAllReduce",
    "reduction_to_one_device": "ReductionToOneDevice",
    "ring": "RING collective",
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A strategy decision.

    Attributes:
      kind: one_device, mirrored, central_storage, multi_worker_mirrored or parameter_server
        (never auto).
      devices: The compute devices, one replica each (on every worker, for multi_worker_mirrored).
      cross_device_ops: The all-reduce for mirrored (a CROSS_DEVICE_OPS name) and for
        multi_worker_mirrored (ring or nccl), else None.
      parameter_device: Where central_storage keeps the variables, else None.
      reason: Why this plan, in a few words.
      cluster: The cluster for multi_worker_mirrored and parameter_server, else None.
    """

    kind: str
    devices: Tuple[str, ...]
    cross_device_ops: Optional[str]
    parameter_device: Optional[str]
    reason: str
    cluster: Optional[Cluster] = None

    @property
    def num_replicas(self) -> int:
        """Replicas in sync: whose shares of a batch make one update (1 for parameter_server: each worker's own)."""
        if self.kind == "multi_worker_mirrored":
            return len(self.devices) * self.cluster.num_workers
        if self.kind == "parameter_server":
            return 1
        return len(self.devices)

    @property
    def num_workers(self) -> int:
        """Worker tasks that train: a cluster's workers (parameter servers' or in sync), else 1."""
        if self.kind == "parameter_server":
            return len(self.cluster.jobs["worker"])
        return self.cluster.num_workers if self.kind == "multi_worker_mirrored" else 1

    def describe(self) -> str:
        """One log line: strategy, devices, replicas and all-reduce."""
        if self.kind == "parameter_server":
            return (
                f"strategy: ParameterServerStrategy with {self.num_workers} worker(s) and "
                f"{self.cluster.num_ps} parameter server(s), coordinated by chief:0; updates: "
                f"asynchronous, variables on the parameter servers; {self.cluster.describe()}; {self.reason}"
            )
        if self.kind == "multi_worker_mirrored":
            return (
                f"strategy: MultiWorkerMirroredStrategy on {self.cluster.num_workers} workers x "
                f"{', '.join(self.devices)} ({self.num_replicas} replicas); all-reduce: "
                f"{_ALL_REDUCE_NAMES[self.cross_device_ops]}; {self.cluster.describe()}; {self.reason}"
            )
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
    cluster: Optional[Cluster] = None,
) -> Plan:
    """Chooses the strategy for the given logical GPUs and CPUs (or an explicit device list).

    With a cluster (from TF_CONFIG or SLURM), auto picks parameter_server when it has ps tasks
    and multi_worker_mirrored otherwise; the one-machine kinds are refused.

    Args:
      kind: auto, one_device, mirrored, central_storage, multi_worker_mirrored or parameter_server.
      gpus: The logical GPUs' names, e.g. ["/gpu:0", "/gpu:1"] (fake ones in tests).
      cpus: The logical CPUs' names.
      devices: Devices to use instead of detection.
      cross_device_ops: auto, nccl, hierarchical_copy or reduction_to_one_device.
      platform: sys.platform of the machine (NCCL is Linux's).
      cluster: The cluster this process is a task of, or None.

    Returns:
      The Plan: kind, devices, all-reduce, and why.

    Raises:
      GpuparError: an unknown kind or all-reduce, devices that are not there, or a kind that does
        not fit the devices or the cluster; the message lists what would.
    """
    if kind in STRATEGY_CHOICES and kind not in STRATEGIES:
        raise GpuparError(
            f"strategy={kind} is gpupar's own mode, not a tf.distribute strategy: train with gpupar.fit(..., "
            f"strategy={kind!r}) or the gpupar command"
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
    if cluster is not None or kind in CLUSTER_KINDS:
        return _plan_cluster(kind, gpus, cross_device_ops, platform, cluster, devices)
    chosen, source = _local_devices(gpus, cpus, devices)
    if kind == "auto":
        kind = "mirrored" if len(chosen) > 1 else "one_device"
        reason = f"auto: {source}"
    else:
        reason = f"asked for {kind}: {source}"
    return _plan_local(kind, chosen, bool(devices), cross_device_ops, platform, reason)


def _local_devices(gpus, cpus, devices):
    """(the devices a one-machine strategy runs on, where they came from)."""
    if devices:
        chosen = [short_name(d) for d in devices]
        missing = [d for d in chosen if d not in gpus + cpus]
        if missing:
            raise GpuparError(f"device {missing[0]} does not exist here; available: {', '.join(gpus + cpus)}")
        if len(set(chosen)) != len(chosen):
            raise GpuparError(f"devices={','.join(chosen)} names a device twice")
        return chosen, "devices given"
    if gpus:
        return gpus, f"{len(gpus)} GPU(s) found"
    return cpus, f"no GPU found, {len(cpus)} virtual CPUs" if len(cpus) > 1 else "no GPU found"


def _plan_local(kind, chosen, given, cross_device_ops, platform, reason):
    """The Plan of a one-machine kind on the chosen devices (all of them when `given`)."""
    if kind == "one_device":
        if not given:
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


def _plan_cluster(kind, gpus, cross_device_ops, platform, cluster, devices):
    if cluster is None:
        raise GpuparError(
            f"strategy={kind} needs a cluster, but neither TF_CONFIG nor SLURM describes one (a "
            "TF_CONFIG set after TensorFlow started is not seen either). Set TF_CONFIG before "
            "starting each task, or try it on this machine with: gpupar launch --workers=2 -- "
            f"--strategy={kind} ..."
        )
    where = cluster.describe()
    if kind not in ("auto", *CLUSTER_KINDS):
        raise GpuparError(
            f"strategy={kind} runs on one machine, but there is a {where}; use "
            "multi_worker_mirrored or parameter_server (or auto), or unset TF_CONFIG"
        )
    if devices:
        raise GpuparError("devices=... picks devices on one machine; with a cluster, each task uses all its GPUs "
                          "(limit them with gpus=...)")
    if kind == "auto":
        kind = "parameter_server" if cluster.num_ps else "multi_worker_mirrored"
        reason = f"auto: {cluster.num_ps} ps task(s) in the cluster" if cluster.num_ps else "auto: a cluster without ps tasks"
    else:
        reason = f"asked for {kind}"
    local = tuple(gpus) if gpus else ("/cpu:0",)
    if kind == "parameter_server":
        if not cluster.num_ps or "chief" not in cluster.jobs or not cluster.jobs.get("worker"):
            raise GpuparError(
                f"strategy=parameter_server needs a chief (the coordinator), ps and worker tasks, but "
                f"the {where}; e.g. gpupar launch --workers=2 --ps=1 -- --strategy=parameter_server ..."
            )
        if cross_device_ops != "auto":
            raise GpuparError(f"cross_device_ops={cross_device_ops} is an all-reduce; parameter_server has none (use auto)")
        if len(gpus) > 1:
            raise GpuparError(
                f"strategy=parameter_server with {len(gpus)} GPUs per task: gpupar's worker step runs one replica "
                "per worker; give each worker one GPU (gpupar launch --gpus_per_worker=1, or gpus=0), with more "
                "workers for more GPUs")
        return Plan("parameter_server", local, None, None, reason, cluster)
    if cluster.num_ps:
        raise GpuparError(f"strategy=multi_worker_mirrored has no parameter servers, but the {where}; "
                          "use strategy=parameter_server (or auto), or drop the ps job")
    # Between workers the all-reduce is a collective: RING (gRPC) on CPUs, NCCL between GPUs.
    if cross_device_ops == "auto":
        reduce = "nccl" if gpus and platform.startswith("linux") else "ring"
    elif cross_device_ops == "nccl" and gpus:
        reduce = "nccl"
    else:
        raise GpuparError(
            f"cross_device_ops={cross_device_ops} does not work between workers; multi_worker_mirrored "
            f"takes auto (RING collectives, NCCL between GPUs on Linux){' or nccl' if gpus else ' (nccl needs GPUs)'}"
        )
    return Plan("multi_worker_mirrored", local, reduce, None, reason, cluster)


def _choose_all_reduce(requested, devices, platform):
    all_gpu = all(d.startswith("/gpu:") for d in devices)
    # TensorFlow's hierarchical copy sums the halves [0:n//2] and [n//2:2*(n//2)] ("only works for
    # DGX-1"): with an odd count the last replica's gradient is left out.
    odd = len(devices) % 2 == 1
    if requested == "auto":
        if not all_gpu:
            return "reduction_to_one_device"
        # TensorFlow's Linux GPU builds ship NCCL; elsewhere hierarchical copy, but not for an odd count.
        if platform.startswith("linux"):
            return "nccl"
        return "reduction_to_one_device" if odd else "hierarchical_copy"
    if requested in ("nccl", "hierarchical_copy") and not all_gpu:
        raise GpuparError(
            f"cross_device_ops={requested} all-reduces between GPUs, but the devices are "
            f"{', '.join(devices)}; use reduction_to_one_device (or auto) on CPUs"
        )
    if requested == "hierarchical_copy" and odd:
        raise GpuparError(
            f"cross_device_ops=hierarchical_copy with {len(devices)} GPUs would drop one replica's gradients "
            "(TensorFlow's implementation sums two equal halves); use nccl or reduction_to_one_device, or an "
            "even number of GPUs"
        )
    return requested


def jit_compile_refusal(plan: Plan) -> Optional[str]:
    """Why XLA cannot compile a replica's step on this plan (several replicas on CPUs), or None where it can.

    Between GPUs a MirroredStrategy replica's step compiles with its NCCL all-reduce; on CPU
    devices XLA has no cross-replica collectives, so the step runs without XLA there.
    """
    if plan.num_replicas > 1 and not all(d.startswith("/gpu:") for d in plan.devices):
        return (f"jit_compile: XLA cannot compile tf.distribute's all-reduce between the {plan.num_replicas} CPU "
                "replicas, so the step runs without XLA (it compiles on one device, or between GPUs)")
    return None


SHARD_BYTES = 256 << 10  # parameter servers: variables this large or larger are split, in shards at least this large


def max_shards(num_ps: int, ps_shards: Optional[int]) -> int:
    """Parameter servers: the most shards one large variable is split into (1: none split).

    ps_shards None splits over every ps task; more shards than ps tasks would put two on one.
    """
    return min(num_ps, ps_shards or num_ps)


def build_strategy(plan: Plan, ps_shards: Optional[int] = None):
    """Creates the tf.distribute.Strategy a Plan describes.

    Args:
      plan: From plan_strategy.
      ps_shards: parameter_server: split each variable of SHARD_BYTES or more into up to this
        many shards over the ps tasks (max_shards); None: one per ps task.

    Returns:
      The strategy.

    Raises:
      GpuparError: a cluster strategy that TensorFlow, already started, cannot join.
    """
    import tensorflow as tf

    if plan.kind in CLUSTER_KINDS:
        return _build_cluster_strategy(tf, plan, ps_shards)
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


_SHARED = {}  # the process's strategies, by what made them: (plan's key, ps_shards) -> strategy


def shared_strategy(plan: Plan, ps_shards: Optional[int] = None):
    """The process's tf.distribute.Strategy for a Plan: built the first time, the same object every time after.

    Every gpupar.fit and gpupar.strategy call of a process with the same devices and kind gets
    this one object, so a model (or a layer, or a trained teacher) made under it in one fit trains
    in the next: TensorFlow gives optimizer slots only to variables of the strategy they were
    made under.

    Raises:
      GpuparError: as build_strategy.
    """
    cluster = plan.cluster.describe() if plan.cluster is not None else None
    key = (plan.kind, plan.devices, plan.cross_device_ops, plan.parameter_device, cluster, ps_shards)
    if key not in _SHARED:
        _SHARED[key] = build_strategy(plan, ps_shards)
    return _SHARED[key]


def _build_cluster_strategy(tf, plan: Plan, ps_shards: Optional[int] = None):
    """MultiWorkerMirroredStrategy or ParameterServerStrategy on the plan's cluster, checked.

    The resolver is built from the parsed cluster, so the strategy sees exactly the cluster that
    was validated; the check after creating a multi-worker one catches a strategy that still sees
    one worker.
    """
    c = plan.cluster
    warn_if_reachable(c.task_name, c.jobs[c.task_type][c.task_index])
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({job: list(a) for job, a in c.jobs.items()}),
        task_type=c.task_type, task_id=c.task_index, rpc_layer="grpc",
    )
    if plan.kind == "parameter_server":
        shards = max_shards(c.num_ps, ps_shards)
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=SHARD_BYTES, max_shards=shards) if shards > 1 else None
        # It connects to the cluster's servers whenever it is made, so there is nothing to check after.
        return tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    implementation = {
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[plan.cross_device_ops]
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver,
            communication_options=tf.distribute.experimental.CommunicationOptions(implementation=implementation),
        )
    except RuntimeError as e:  # "Collective ops must be configured at program startup"
        raise TensorFlowStarted(
            f"MultiWorkerMirroredStrategy could not join the cluster: TensorFlow was already running "
            f"in this process ({e}). Create it first thing in each task: call gpupar.fit_mnist or "
            "gpupar.make_strategy before any other TensorFlow work, in a fresh process"
        ) from None
    if strategy.num_replicas_in_sync != plan.num_replicas:
        raise TensorFlowStarted(
            f"MultiWorkerMirroredStrategy sees {strategy.num_replicas_in_sync} replicas, but the cluster has "
            f"{plan.num_replicas}: TensorFlow was set up before the strategy. Create it first thing in each task "
            "(gpupar does, unless other TensorFlow work ran earlier in this process)"
        )
    return strategy


def detected_plan(kind="auto", devices=None, cross_device_ops="auto", max_cpus=None, cluster=None) -> Plan:
    """Plans from TensorFlow's logical devices; `max_cpus` keeps only the first CPUs.

    With a cluster it looks only at physical GPUs, which leaves TensorFlow's runtime unstarted:
    a multi-worker strategy must be created before it starts.
    """
    import tensorflow as tf

    if cluster is not None or kind in CLUSTER_KINDS:
        gpus = [f"/gpu:{i}" for i, _ in enumerate(tf.config.get_visible_devices("GPU"))]
        return plan_strategy(kind, gpus, ["/cpu:0"], devices=devices, cross_device_ops=cross_device_ops,
                             cluster=cluster)
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    if max_cpus is not None:
        cpus = cpus[:max_cpus]
    return plan_strategy(kind, gpus, cpus, devices=devices, cross_device_ops=cross_device_ops)


def make_strategy(kind="auto", devices=None, cross_device_ops="auto"):
    """The tf.distribute.Strategy for this machine's devices (or cluster); logs the choice.

    The cluster comes from TF_CONFIG or SLURM; call this first thing in each task.

    Args:
      kind: As plan_strategy's.
      devices: Devices to use instead of detection.
      cross_device_ops: As plan_strategy's.

    Returns:
      The strategy, built.

    Raises:
      GpuparError: as plan_strategy, and when a cluster strategy cannot join its cluster.
    """
    from gpupar.runtime.cluster import detect_cluster

    plan = detected_plan(kind, devices, cross_device_ops, cluster=detect_cluster())
    log.info(plan.describe())
    return build_strategy(plan)
