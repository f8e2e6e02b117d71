"""Cluster parsing (TF_CONFIG, SLURM) and the strategy decision for clusters: pure, no processes."""

import json
import os
import re
import sys

import pytest
import yaml

import gpupar

from conftest import ROOT

from gpupar.runtime.cluster import detect_cluster, parse_tf_config, tf_config
from gpupar.errors import GpuparError
from gpupar.runtime.launch import loopback_cluster
from gpupar.runtime.strategy import plan_strategy

TWO_WORKERS = {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}
PS_CLUSTER = {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"], "ps": ["h3:2222"]}


def _config(cluster, task_type="worker", index=0):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def test_two_machines_tf_config():
    cluster = parse_tf_config(_config(TWO_WORKERS, "worker", 1))
    assert cluster.num_workers == 2 and cluster.num_ps == 0
    assert cluster.task_name == "worker:1" and not cluster.is_chief
    assert parse_tf_config(_config(TWO_WORKERS, "worker", 0)).is_chief


def test_chief_is_the_chief_task_when_there_is_one():
    assert parse_tf_config(_config(PS_CLUSTER, "chief", 0)).is_chief
    assert not parse_tf_config(_config(PS_CLUSTER, "worker", 0)).is_chief
    assert parse_tf_config(_config(PS_CLUSTER, "ps", 0)).num_ps == 1


def test_tf_config_round_trips():
    cluster = parse_tf_config(_config(PS_CLUSTER, "worker", 1))
    assert parse_tf_config(tf_config(cluster)) == cluster


def test_tf_config_without_cluster_is_one_machine():
    assert parse_tf_config('{"task": {"type": "worker", "index": 0}}') is None
    assert detect_cluster({}) is None
    assert detect_cluster({"TF_CONFIG": "  "}) is None


@pytest.mark.parametrize("text, field", [
    ("{not json", "is not valid JSON"),
    ('["worker"]', "must be a JSON object"),
    (json.dumps({"cluster": TWO_WORKERS}), "TF_CONFIG task "),
    (json.dumps({"cluster": TWO_WORKERS, "task": {"index": 0}}), "TF_CONFIG task.type is missing"),
    (_config(TWO_WORKERS, "chief", 0), "TF_CONFIG task.type = 'chief' is not a job"),
    (_config(TWO_WORKERS, "worker", 2), "TF_CONFIG task.index = 2 is not a task of job 'worker'"),
    (_config(TWO_WORKERS, "worker", "0"), "TF_CONFIG task.index = '0'"),
    (_config({"worker": "10.0.0.1:2222"}), "TF_CONFIG cluster.worker must be a non-empty list"),
    (_config({"worker": ["10.0.0.1"]}), "TF_CONFIG cluster.worker[0] = '10.0.0.1' is not \"host:port\""),
    (_config({"worker": ["a:1", "a:1"]}), "TF_CONFIG cluster.worker names an address twice"),
    (_config({"trainer": ["a:1"]}, "trainer"), "TF_CONFIG cluster.trainer is not a job"),
    (_config({"ps": ["a:1"]}, "ps"), "has no worker or chief task"),
    (_config({"chief": ["a:1", "b:1"], "worker": ["c:1"]}), "TF_CONFIG cluster.chief has 2 tasks"),
])
def test_malformed_tf_config_names_the_field(text, field):
    with pytest.raises(GpuparError, match="TF_CONFIG") as error:
        detect_cluster({"TF_CONFIG": text})
    assert field in str(error.value)


def test_slurm_with_one_task_is_one_machine():
    assert detect_cluster({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None


def test_slurm_needs_enough_tasks_for_its_parameter_servers():
    with pytest.raises(GpuparError, match="slurm_ps=2 needs at least 4 SLURM tasks"):
        detect_cluster({"SLURM_PROCID": "0", "SLURM_NTASKS": "3"}, slurm_ps=2)


def test_slurm_job_step_through_tensorflows_resolver(monkeypatch):
    """TensorFlow's SlurmClusterResolver reads the job step's variables (no scontrol, no nvidia-smi)."""
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cluster = detect_cluster(env)
    assert cluster.source == "SLURM" and cluster.num_workers == 2
    assert cluster.task_name == "worker:1" and cluster.jobs["worker"] == ("n1:8888", "n2:8888")


def _plan(kind, cluster_json, gpus=(), **kw):
    return plan_strategy(kind, list(gpus), ["/cpu:0"], cluster=parse_tf_config(cluster_json), **kw)


def test_auto_picks_multi_worker_mirrored_for_a_cluster_of_workers():
    plan = _plan("auto", _config(TWO_WORKERS))
    assert plan.kind == "multi_worker_mirrored" and plan.cross_device_ops == "ring"
    assert (plan.num_replicas, plan.num_workers) == (2, 2) and plan.devices == ("/cpu:0",)
    assert "MultiWorkerMirroredStrategy on 2 workers" in plan.describe()


def test_multi_worker_mirrored_uses_nccl_between_gpus_on_linux():
    plan = _plan("auto", _config(TWO_WORKERS), gpus=["/gpu:0", "/gpu:1"], platform="linux")
    assert plan.cross_device_ops == "nccl" and plan.num_replicas == 4


def test_auto_picks_parameter_server_when_the_cluster_has_ps_tasks():
    plan = _plan("auto", _config(PS_CLUSTER, "chief"))
    assert plan.kind == "parameter_server" and (plan.num_workers, plan.num_replicas) == (2, 1)
    assert "ParameterServerStrategy with 2 worker(s) and 1 parameter server(s)" in plan.describe()


@pytest.mark.parametrize("kind, cluster, message", [
    ("mirrored", TWO_WORKERS, "strategy=mirrored runs on one machine"),
    ("parameter_server", TWO_WORKERS, "strategy=parameter_server needs a chief"),
    ("multi_worker_mirrored", PS_CLUSTER, "has no parameter servers"),
])
def test_kind_that_does_not_fit_the_cluster(kind, cluster, message):
    with pytest.raises(GpuparError, match=message):
        _plan(kind, _config(cluster))


@pytest.mark.parametrize("kind", ["multi_worker_mirrored", "parameter_server"])
def test_cluster_kind_without_a_cluster_says_how_to_get_one(kind):
    with pytest.raises(GpuparError, match="needs a cluster.*gpupar launch"):
        plan_strategy(kind, [], ["/cpu:0"])


def test_all_reduce_between_workers_is_a_collective():
    with pytest.raises(GpuparError, match="does not work between workers"):
        _plan("multi_worker_mirrored", _config(TWO_WORKERS), cross_device_ops="hierarchical_copy")
    with pytest.raises(GpuparError, match="nccl needs GPUs"):
        _plan("multi_worker_mirrored", _config(TWO_WORKERS), cross_device_ops="nccl")


def test_launcher_cluster_is_on_loopback_with_distinct_ports():
    jobs = loopback_cluster(2, 1)
    assert set(jobs) == {"chief", "worker", "ps"} and len(jobs["worker"]) == 2
    addresses = [a for job in jobs.values() for a in job]
    assert all(a.startswith("127.0.0.1:") for a in addresses) and len(set(addresses)) == 4
    assert set(loopback_cluster(3, 0)) == {"worker"}


def test_launch_takes_its_own_flags_and_gives_the_rest_to_every_task(monkeypatch):
    from gpupar import cli
    from gpupar.runtime import launch

    started = []
    monkeypatch.setattr(launch, "launch", lambda *args: started.append(args) or 0)
    cli.FLAGS.unparse_flags()
    argv = cli.FLAGS(["gpupar", "launch", "--workers=3", "--ps=1", "--", "--epochs=2", "--model_dir=runs/x"])
    try:
        assert cli.main(argv) == 0
        assert started == [(3, 1, 0, ["--epochs=2", "--model_dir=runs/x"], None, False)]
        cli.FLAGS.unparse_flags()
        argv = cli.FLAGS(["gpupar", "launch", "--epochs=2"])
        assert cli.main(argv) == 2 and len(started) == 1  # a training flag before --: refused, nothing started
    finally:
        cli.FLAGS.unparse_flags()


def test_launch_runs_gpupar_for_flags_and_a_command_as_given():
    from gpupar.runtime.launch import restart_command, task_command

    gpupar = [sys.executable, "-m", "gpupar"]
    assert task_command(["--epochs=2"]) == [*gpupar, "--epochs=2"]
    assert task_command([]) == gpupar  # the default training run
    assert task_command(["python", "train.py", "--epochs=2"]) == ["python", "train.py", "--epochs=2"]
    # A restart resumes gpupar's own runs; a script's command is its own business (resume=True).
    assert restart_command([*gpupar, "--epochs=2"]) == [*gpupar, "--epochs=2", "--resume"]
    assert restart_command([*gpupar, "--resume_from=m/ckpt-3"]) == [*gpupar, "--resume_from=m/ckpt-3"]
    assert restart_command(["python", "train.py", "--resume"]) == ["python", "train.py", "--resume"]
    assert restart_command(["python", "train.py"]) == ["python", "train.py"]


def test_launch_refuses_a_command_that_cannot_run_before_starting_anything():
    import subprocess

    result = subprocess.run([sys.executable, "-m", "gpupar", "launch", "--workers=2", "--", "nosuchcommand", "x.py"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "[launch] started" not in result.stdout
    (line,) = result.stderr.strip().splitlines()
    assert "the command after -- ('nosuchcommand') is not a program on PATH" in line


def test_launch_refuses_a_bad_count_before_starting_anything():
    import subprocess

    result = subprocess.run([sys.executable, "-m", "gpupar", "launch", "--workers=0", "--", "--epochs=1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "flag --workers=0: 0 is not a positive integer" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("rank, task", [(0, "chief:0"), (1, "ps:0"), (2, "worker:0"), (3, "worker:1")])
def test_slurm_parameter_servers_follow_the_chief(monkeypatch, rank, task):
    env = {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cluster = detect_cluster(env, slurm_ps=1)
    assert cluster.task_name == task and cluster.jobs == {
        "chief": ("n1:8888",), "ps": ("n1:8889",), "worker": ("n2:8888", "n2:8889")}


def _documented_tfjob():
    """The TFJob and NetworkPolicy of docs/multi-machine.md's yaml block."""
    text = open(os.path.join(ROOT, "docs", "multi-machine.md")).read()
    (block,) = re.findall(r"```yaml\n(.*?)```", text, re.S)
    return {d["kind"]: d for d in yaml.safe_load_all(block)}


def _operator_tf_config(job, replica_type, index):
    """The TF_CONFIG Kubeflow's training operator sets in a TFJob's pod (its genTFConfigJSONStr)."""
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    cluster = {}
    for kind, spec in job["spec"]["tfReplicaSpecs"].items():
        (container,) = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "tensorflow"]
        port = next(p["containerPort"] for p in container.get("ports", ()) if p["name"] == "tfjob-port")
        cluster[kind.lower()] = [f"{name}-{kind.lower()}-{i}.{namespace}.svc:{port}" for i in range(spec["replicas"])]
    return json.dumps({"cluster": cluster, "task": {"type": replica_type, "index": index}, "environment": "cloud"})


def test_the_documented_tfjob_gives_gpupar_its_cluster():
    documents = _documented_tfjob()
    job = documents["TFJob"]
    workers = job["spec"]["tfReplicaSpecs"]["Worker"]
    assert workers["template"]["spec"]["containers"][0]["command"] == ["python", "train.py"]  # the script, unchanged
    for index in range(workers["replicas"]):
        cluster = detect_cluster({"TF_CONFIG": _operator_tf_config(job, "worker", index)})
        assert (cluster.task_type, cluster.task_index, cluster.num_workers) == ("worker", index, 2)
        assert cluster.jobs["worker"][index] == f"gpupar-train-worker-{index}.ml.svc:2222"
        assert plan_strategy("auto", [], ["/cpu:0"], cluster=cluster).kind == "multi_worker_mirrored"
    # Its NetworkPolicy admits only the job's own pods, on the port of TF_CONFIG.
    policy = documents["NetworkPolicy"]["spec"]
    own = {"training.kubeflow.org/job-name": job["metadata"]["name"]}
    assert policy["podSelector"]["matchLabels"] == own and policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": own}}] and rule["ports"] == [{"port": 2222}]


def test_large_variables_split_over_the_ps_tasks_unless_told_otherwise():
    from gpupar.runtime.strategy import max_shards

    assert max_shards(num_ps=2, ps_shards=None) == 2  # one shard per ps task
    assert max_shards(num_ps=1, ps_shards=None) == 1  # nothing to split over
    assert max_shards(num_ps=4, ps_shards=2) == 2 and max_shards(num_ps=2, ps_shards=1) == 1
    assert max_shards(num_ps=2, ps_shards=8) == 2  # never two shards of one variable on one ps task


def test_ps_shards_is_refused_where_there_are_no_parameter_servers():
    from gpupar.training import modes

    ps_cluster = parse_tf_config(_config(PS_CLUSTER, "chief", 0))
    assert modes.checked(gpupar.Config(ps_shards=2), ps_cluster).name == "parameter_server"  # auto, ps tasks found
    with pytest.raises(GpuparError, match=r"ps_shards=2 splits variables over the ps tasks of strategy=parameter_server"):
        modes.checked(gpupar.Config(ps_shards=2, strategy="mirrored"))
    with pytest.raises(GpuparError, match=r"ps_shards=0: must be a whole number > 0"):
        gpupar.Config(ps_shards=0)
    with pytest.raises(GpuparError, match="ps_shards=2 splits variables"):
        modes.checked(gpupar.Config(ps_shards=2))  # auto, once a run found no ps tasks
