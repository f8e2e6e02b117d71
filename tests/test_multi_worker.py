"""Synchronous training on two worker processes (MultiWorkerMirroredStrategy) on loopback."""

import json
import os
import re
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import gpupar
from conftest import make_idx_dir
from launching import Launch

ATOL = 1e-5  # as in test_train: reordered float32 sums only


def _state(checkpoint):
    """Every variable in a checkpoint: weights, batch-norm statistics, Adam's moments, counters."""
    reader = tf.train.load_checkpoint(checkpoint)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(checkpoint)
            if name.endswith("VARIABLE_VALUE")}


@pytest.mark.slow
def test_two_workers_reach_the_weights_of_two_replicas_in_one_process(shared_idx_dir, tmp_path):
    common = dict(data_dir=shared_idx_dir, epochs=1, steps_per_epoch=4, per_replica_batch_size=16, dropout=0.0,
                  sync_batch_norm=True, seed=0, display_step=100)
    launch = Launch(["--workers=2"], [f"--{k}={v}" for k, v in common.items()] + [
        "--strategy=multi_worker_mirrored", f"--model_dir={tmp_path / 'two_workers'}",
        f"--metrics_json={tmp_path / 'metrics.json'}"])
    one = gpupar.fit_mnist(strategy="mirrored", virtual_cpus=2, model_dir=str(tmp_path / "one_process"), **common)
    assert launch.finish(timeout=180) == 0, launch.output[-3000:]
    launch.assert_no_strays()
    out = launch.output
    assert "[worker:0] strategy: MultiWorkerMirroredStrategy on 2 workers x /cpu:0 (2 replicas)" in out
    assert "[worker:0] Epoch:[0] loss:" in out and "[worker:1] Epoch:[0] loss:" in out

    workers = _state(str(tmp_path / "two_workers" / "ckpt-1"))
    single = _state(one.checkpoint)
    assert one.replicas == 2 and workers.keys() == single.keys() and len(workers) > 40
    texts = [k for k in workers if isinstance(workers[k], bytes)]  # the model's name, the epoch's totals
    assert [workers[k] for k in texts] == [single[k] for k in texts]
    # Each replica's own value of a metric (step_state_by_replica) is kept where one process holds all the
    # replicas; two workers hold one each, and their metrics' sums are among the values compared.
    by_replica = [k for k in workers if k.startswith("step_state_by_replica")]
    difference = max(float(np.max(np.abs(workers[k] - single[k]))) for k in workers
                     if k not in texts + by_replica and np.size(workers[k]))
    assert difference < ATOL, difference
    keras.utils.set_random_seed(0)
    initial = gpupar.build_convnet(0.0, seed=0).get_weights()
    moved = max(float(np.max(np.abs(w - w0))) for w, w0 in zip(one.model.get_weights(), initial))
    assert moved > 100 * ATOL  # training really changed the weights
    # Only the chief keeps files: one checkpoint series, and the non-chief's scratch folder is gone.
    assert sorted(os.listdir(tmp_path / "two_workers")) == [
        ".gpupar.lock", "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index", "tensorboard"]
    assert f"saved {tmp_path / 'two_workers' / '.scratch-worker-1'}/ckpt-1" in out
    assert (tmp_path / "metrics.json").exists()


def _checkpoint_position(model_dir):
    """(epochs, steps) of the newest checkpoint in model_dir, or None."""
    best = None
    for sub in ("", "within_epoch"):
        path = tf.train.latest_checkpoint(os.path.join(model_dir, sub))
        if path:
            reader = tf.train.load_checkpoint(path)
            position = tuple(int(reader.get_tensor(f"{n}/.ATTRIBUTES/VARIABLE_VALUE")) for n in ("epoch", "step"))
            best = max(best or position, position)
    return best


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_restarted_and_the_run_completes(tmp_path):
    data_dir = make_idx_dir(tmp_path / "data", num_train=512, num_test=100)
    model_dir = tmp_path / "model"
    launch = Launch(["--workers=2", "--restarts=1"], [
        "--strategy=multi_worker_mirrored", f"--data_dir={data_dir}", "--epochs=5", "--per_replica_batch_size=16",
        "--dropout=0", "--display_step=1000", "--checkpoint_every_steps=4", f"--model_dir={model_dir}",
        f"--metrics_json={tmp_path / 'metrics.json'}"])
    try:
        launch.kill_when(r"\[worker:0\] Epoch:\[0\] loss:", "worker:1")
        killed_at = _checkpoint_position(str(model_dir))  # the chief may still save once: read after the kill
        status = launch.finish(timeout=180)
    finally:
        launch.kill_all()
    assert status == 0, launch.output[-3000:]
    launch.assert_no_strays()
    out = launch.output
    assert "worker:1: -9" in out and "restarting the cluster with --resume" in out
    assert len(launch.task_pids()["worker:0"]) == 2 and len(launch.task_pids()["worker:1"]) == 2
    resumed = re.search(r"\[worker:0\] resumed from \S+ after (\d+) epoch\(s\) and (\d+) step\(s\)", out)
    assert resumed, out[-3000:]
    # Nothing lost beyond the last checkpoint: the restart continues from the newest one there was.
    assert (int(resumed[1]), int(resumed[2])) >= killed_at >= (1, 0)
    # The epoch count is intact: one checkpoint per epoch, and the restarted run trained the rest;
    # metrics_json is written after every epoch, so the history keeps the killed run's epochs too.
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["start_epoch"] == int(resumed[1])
    assert [r["epoch"] for r in metrics["history"]] == list(range(5))
    assert sorted(f for f in os.listdir(model_dir) if f.startswith("ckpt-") and f.endswith(".index")) == [
        f"ckpt-{n}.index" for n in range(1, 6)]
    assert not os.path.exists(model_dir / ".scratch-worker-1")  # the killed worker's, removed by its restart


USER_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "user_fit.py")


@pytest.mark.slow
@pytest.mark.parametrize("form", [[], ["guide"]], ids=["model_fn", "two_renames"])
def test_a_users_own_script_under_launch_trains_resumes_after_a_killed_worker_and_leaves_nothing(tmp_path, form):
    model_dir = tmp_path / "model"
    launch = Launch(["--workers=2", "--restarts=1"],
                    [sys.executable, USER_SCRIPT, str(model_dir), "multi_worker_mirrored", "4", *form])
    try:
        launch.kill_when(r"\[worker:0\] Epoch:\[0\] loss:", "worker:1")
        status = launch.finish(timeout=180)
    finally:
        launch.kill_all()
    assert status == 0, launch.output[-3000:]
    launch.assert_no_strays()
    out = launch.output
    assert "restarting the cluster with the same command" in out
    assert re.search(r"\[worker:0\] resumed from \S+ after [1-9]\d* epoch\(s\)", out), out[-3000:]
    # Both workers end with the same weights, as two replicas of one synchronous run.
    done = dict(re.findall(r"\[(worker:\d)\] user_fit done: 2 replicas, .*weights (\S+)", out))
    assert set(done) == {"worker:0", "worker:1"} and done["worker:0"] == done["worker:1"], out[-3000:]
    assert sorted(f for f in os.listdir(model_dir) if f.startswith("ckpt-") and f.endswith(".index")) == [
        f"ckpt-{n}.index" for n in range(1, 5)]


@pytest.mark.slow
def test_a_model_with_its_own_train_step_trains_on_two_workers_to_the_same_weights(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "scripts", "user_gan.py")
    launch = Launch(["--workers=2"], [sys.executable, script, str(tmp_path / "model"), "2"])
    status = launch.finish(timeout=240)
    assert status == 0, launch.output[-3000:]
    launch.assert_no_strays()
    done = dict(re.findall(r"\[(worker:\d)\] user_gan done: 2 replicas, d_loss \S+, weights (\S+)", launch.output))
    assert set(done) == {"worker:0", "worker:1"} and done["worker:0"] == done["worker:1"], launch.output[-3000:]
    metrics = json.loads((tmp_path / "model" / "metrics.json").read_text())
    assert set(metrics["logs"]) == {"d_loss", "g_loss"} and len(metrics["history"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("form", [[], ["guide"]], ids=["model_fn", "two_renames"])
def test_the_parameter_server_script_runs_unchanged_on_synchronous_workers(tmp_path, form):
    """tests/scripts/user_dataset_fn.py, run with ps tasks in test_parameter_server.py, on two workers alone; also
    written to Keras' multi-GPU guide (gpupar.strategy() joins the cluster, gpupar.fit(model, ...))."""
    script = os.path.join(os.path.dirname(__file__), "scripts", "user_dataset_fn.py")
    launch = Launch(["--workers=2"], [sys.executable, script, str(tmp_path / "model"), "2", *form])
    status = launch.finish(timeout=240)
    assert status == 0, launch.output[-3000:]
    launch.assert_no_strays()
    done = dict(re.findall(r"\[(worker:\d)\] user_dataset_fn done: strategy: (MultiWorkerMirroredStrategy) .*val_accuracy "
                           r"(?:\S+), weights", launch.output))
    assert set(done) == {"worker:0", "worker:1"}, launch.output[-3000:]
    weights = re.findall(r"\[worker:\d\] user_dataset_fn done: .*weights (\S+)", launch.output)
    assert len(set(weights)) == 1  # two replicas of one synchronous run
    metrics = json.loads((tmp_path / "model" / "metrics.json").read_text())
    assert metrics["replicas"] == 2 and metrics["logs"]["val_accuracy"] > 0.9


@pytest.mark.slow
def test_sigterm_to_one_worker_stops_all_after_the_same_step_with_a_checkpoint(tmp_path):
    data_dir = make_idx_dir(tmp_path / "data", num_train=2048, num_test=100)
    model_dir = tmp_path / "model"
    launch = Launch(["--workers=2"], [
        "--strategy=multi_worker_mirrored", f"--data_dir={data_dir}", "--epochs=20", "--per_replica_batch_size=16",
        "--display_step=1000", "--steps_per_call=1", f"--model_dir={model_dir}"])  # a check after every step
    try:
        launch.wait_for(r"\[worker:0\] Epoch:\[0\] loss:", timeout=120)
        os.kill(launch.task_pids()["worker:1"][0], signal.SIGTERM)  # as a scheduler preempting one machine
        status = launch.finish(timeout=120)
    finally:
        launch.kill_all()
    launch.assert_no_strays()
    assert status == 143, launch.output[-3000:]
    # The workers agree to stop at their next common check: within an epoch (a step checkpoint,
    # within_epoch/step-<global step>) or, when the signal lands while they finish an epoch, at
    # its end (that epoch's ckpt-<epochs>). Either way both save the same one: the chief into
    # model_dir, worker:1 into its scratch folder.
    saved = dict(re.findall(r"\[(worker:\d)\] gpupar: interrupted by SIGTERM \(saved (\S+);", launch.output))
    assert set(saved) == {"worker:0", "worker:1"}, launch.output[-3000:]
    name = re.fullmatch(rf"{re.escape(str(model_dir))}/(ckpt-\d+|within_epoch/step-\d+)", saved["worker:0"])
    assert name, saved
    assert saved["worker:1"] == str(model_dir / ".scratch-worker-1" / name[1])
    # It is the newest checkpoint on disk, and it is past the epoch that had ended before the signal.
    assert tf.train.latest_checkpoint(os.path.dirname(saved["worker:0"])) == saved["worker:0"]
    reader = tf.train.load_checkpoint(saved["worker:0"])
    position = tuple(int(reader.get_tensor(f"{n}/.ATTRIBUTES/VARIABLE_VALUE")) for n in ("epoch", "step"))
    assert _checkpoint_position(str(model_dir)) == position >= (1, 0)
    assert not os.path.exists(model_dir / ".scratch-worker-1")


LATE_STRATEGY = """
import os, sys
import tensorflow as tf
tf.constant(1.0) + 1  # TensorFlow runs before the strategy exists
import gpupar
try:
    gpupar.fit_mnist(strategy="multi_worker_mirrored", data_dir=sys.argv[1], epochs=1)
except gpupar.GpuparError as e:
    print("GpuparError:", e)
sys.stdout.flush()
os._exit(0)
"""


def test_a_strategy_created_after_tensorflow_started_is_a_clear_error(shared_idx_dir):
    tf_config = json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}})
    result = subprocess.run([sys.executable, "-c", LATE_STRATEGY, shared_idx_dir], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "TF_CONFIG": tf_config, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert "GpuparError: MultiWorkerMirroredStrategy could not join the cluster: TensorFlow was already running" in \
        result.stdout, result.stdout + result.stderr[-2000:]
