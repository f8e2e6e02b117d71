"""Which cluster this process belongs to: TF_CONFIG or SLURM, parsed into a Cluster.

`parse_tf_config` and `cluster_from_spec` are pure, so tests call them with made-up values;
`detect_cluster` reads the environment (and, under SLURM, asks TensorFlow's SlurmClusterResolver).
Importing this module does not import TensorFlow.
"""

import dataclasses
import json
import os
from typing import Dict, Mapping, Optional, Tuple

from gpupar.errors import GpuparError

JOBS = ("chief", "worker", "ps", "evaluator")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster and this process's task in it.

    Attributes:
      jobs: Job name -> task addresses ("host:port"), e.g. {"worker": ("10.0.0.1:2222", ...)}.
      task_type: This process's job: chief, worker, ps or evaluator.
      task_index: This process's index within its job.
      source: Where it came from: "TF_CONFIG" or "SLURM".
    """

    jobs: Mapping[str, Tuple[str, ...]]
    task_type: str
    task_index: int
    source: str

    @property
    def num_workers(self) -> int:
        """Tasks that compute: workers plus the chief (which trains too in synchronous mode)."""
        return len(self.jobs.get("worker", ())) + len(self.jobs.get("chief", ()))

    @property
    def num_ps(self) -> int:
        return len(self.jobs.get("ps", ()))

    @property
    def is_chief(self) -> bool:
        """The chief writes checkpoints and summaries: task chief:0, or worker:0 without a chief."""
        if "chief" in self.jobs:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def task_name(self) -> str:
        return f"{self.task_type}:{self.task_index}"

    def describe(self) -> str:
        sizes = ", ".join(f"{len(a)} {job}" for job, a in self.jobs.items())
        return f"cluster from {self.source}: {sizes}; this is {self.task_name}{' (chief)' if self.is_chief else ''}"


def _bad(field, problem, fix="see the README section 'Running on several machines'"):
    return GpuparError(f"TF_CONFIG {field} {problem}; {fix}")


def cluster_from_spec(jobs, task_type, task_index, source: str, field_prefix: str = "") -> Cluster:
    """Validates a job -> addresses mapping and a task into a Cluster; errors name the bad field."""
    p = field_prefix
    if not isinstance(jobs, dict) or not jobs:
        raise _bad(f"{p}cluster", f"must be an object of jobs such as {{\"worker\": [\"host:port\", ...]}}, got {jobs!r}")
    parsed: Dict[str, Tuple[str, ...]] = {}
    for job, addresses in jobs.items():
        if job not in JOBS:
            raise _bad(f"{p}cluster.{job}", f"is not a job gpupar knows; jobs are: {', '.join(JOBS)}")
        if not isinstance(addresses, (list, tuple)) or not addresses:
            raise _bad(f"{p}cluster.{job}", f"must be a non-empty list of \"host:port\" strings, got {addresses!r}")
        for i, address in enumerate(addresses):
            host, _, port = str(address).rpartition(":") if isinstance(address, str) else ("", "", "")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise _bad(f"{p}cluster.{job}[{i}]", f"= {address!r} is not \"host:port\" (e.g. \"10.0.0.1:2222\")")
        if len(set(addresses)) != len(addresses):
            raise _bad(f"{p}cluster.{job}", f"names an address twice: {list(addresses)}")
        parsed[job] = tuple(addresses)
    if len(parsed.get("chief", ())) > 1:
        raise _bad(f"{p}cluster.chief", f"has {len(parsed['chief'])} tasks; there is at most one chief")
    if not parsed.get("worker") and not parsed.get("chief"):
        raise _bad(f"{p}cluster", "has no worker or chief task; name at least one worker")
    if task_type not in parsed:
        raise _bad(f"{p}task.type", f"= {task_type!r} is not a job of the cluster ({', '.join(parsed)})")
    if not isinstance(task_index, int) or isinstance(task_index, bool) or not 0 <= task_index < len(parsed[task_type]):
        raise _bad(
            f"{p}task.index", f"= {task_index!r} is not a task of job {task_type!r}, which has "
            f"{len(parsed[task_type])} (indices 0..{len(parsed[task_type]) - 1})",
        )
    return Cluster(parsed, task_type, task_index, source)


def parse_tf_config(text: str) -> Optional[Cluster]:
    """The Cluster a TF_CONFIG value describes; None for a TF_CONFIG without a cluster (one machine)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad("", f"is not valid JSON ({e.msg} at character {e.pos})", "it must be like "
                   '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}') from None
    if not isinstance(value, dict):
        raise _bad("", f"must be a JSON object, got {type(value).__name__}")
    if not value.get("cluster"):
        return None  # TensorFlow treats this as a local run too
    task = value.get("task")
    if not isinstance(task, dict):
        raise _bad("task", f"must be an object like {{\"type\": \"worker\", \"index\": 0}}, got {task!r}")
    if "type" not in task:
        raise _bad("task.type", "is missing; give the job of this process, e.g. \"worker\"")
    return cluster_from_spec(value["cluster"], task["type"], task.get("index", 0), "TF_CONFIG")


def _slurm_tasks(environ) -> int:
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return 0


def detect_cluster(environ=None, slurm_ps: int = 0) -> Optional[Cluster]:
    """The cluster from TF_CONFIG, else from SLURM (a job step of several tasks), else None.

    Under SLURM, tasks are numbered by SLURM_PROCID: with slurm_ps > 0 the first is the chief
    (coordinator), the next slurm_ps are parameter servers and the rest workers; otherwise
    every task is a worker. Ports start at 8888 (TensorFlow's SlurmClusterResolver default).
    """
    environ = os.environ if environ is None else environ
    if environ.get("TF_CONFIG", "").strip():
        return parse_tf_config(environ["TF_CONFIG"])
    tasks = _slurm_tasks(environ)
    if "SLURM_PROCID" not in environ or tasks < 2:
        return None
    if slurm_ps and tasks < slurm_ps + 2:
        raise GpuparError(
            f"slurm_ps={slurm_ps} needs at least {slurm_ps + 2} SLURM tasks (a chief, the parameter "
            f"servers and a worker), but this job step has {tasks}"
        )
    jobs = {"chief": 1, "ps": slurm_ps, "worker": tasks - slurm_ps - 1} if slurm_ps else {"worker": tasks}
    import tensorflow as tf

    # GPUs are left to SLURM (--gpus-per-task sets CUDA_VISIBLE_DEVICES per task): the resolver
    # would otherwise call nvidia-smi, which CPU nodes lack, and set the variable itself. It also
    # caps tasks per node at gpus_per_node / gpus_per_task, hence "one per task" here.
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
        jobs=jobs, gpus_per_node=tasks, gpus_per_task=1, auto_set_gpu=False)
    spec = resolver.cluster_spec().as_dict()
    return cluster_from_spec({k: list(v) for k, v in spec.items()}, resolver.task_type, resolver.task_id, "SLURM")


def tf_config(cluster: Cluster) -> str:
    """The TF_CONFIG JSON for a Cluster (what the launcher gives each task)."""
    return json.dumps({
        "cluster": {job: list(addresses) for job, addresses in cluster.jobs.items()},
        "task": {"type": cluster.task_type, "index": cluster.task_index},
    })
