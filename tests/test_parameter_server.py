"""Asynchronous training: 2 workers + 1 ps + the chief (coordinator) as processes on loopback."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import make_idx_dir
from launching import Launch, task_pids


def _flags(data_dir, run_dir, **extra):
    flags = {**dict(data_dir=data_dir, epochs=3, per_replica_batch_size=32, learning_rate=1e-2, dropout=0.0, display_step=1000,
                    strategy="parameter_server", model_dir=run_dir / "model", metrics_json=run_dir / "metrics.json"),
             **extra}
    return [f"--{k}={v}" for k, v in flags.items()]


def _updates_by_worker(output):
    """[(epoch, [updates of worker 0, of worker 1])] from the chief's epoch lines."""
    lines = re.findall(r"\[chief:0\] Epoch:\[(\d+)\] loss:.*val_accuracy.*updates by worker: 0: (\d+), 1: (\d+)", output)
    return [(int(e), [int(a), int(b)]) for e, a, b in lines]


@pytest.fixture(scope="module")
def ps_data(tmp_path_factory):
    """1024 training images: 32 steps of 32 per epoch, enough for batch norm to settle."""
    return make_idx_dir(tmp_path_factory.mktemp("ps_data"), num_train=1024, num_test=200)


@pytest.mark.slow
def test_two_workers_and_a_ps_train_the_convnet_well_above_chance(ps_data, tmp_path):
    launch = Launch(["--workers=2", "--ps=1"], _flags(ps_data, tmp_path))
    status = launch.finish(timeout=240)
    assert status == 0, launch.output[-3000:]
    launch.assert_no_strays()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert [r["epoch"] for r in metrics["history"]] == [0, 1, 2]
    assert (metrics["replicas"], metrics["workers"]) == (1, 2)  # each update is one worker's batch
    assert metrics["logs"]["val_accuracy"] > 0.5  # chance is 0.1
    assert "ParameterServerStrategy with 2 worker(s) and 1 parameter server(s)" in metrics["strategy"]
    # Every step was applied by one worker or the other, and both took part.
    updates = _updates_by_worker(launch.output)
    assert [e for e, _ in updates] == [0, 1, 2]
    assert all(sum(u) == 32 for _, u in updates) and sum(u[0] for _, u in updates) > 0 and sum(u[1] for _, u in updates) > 0
    # The variables lived on the ps task: the chief's checkpoint holds them, one series.
    files = sorted(f for f in os.listdir(tmp_path / "model") if f.endswith(".index"))
    assert files == ["ckpt-1.index", "ckpt-2.index", "ckpt-3.index"]


@pytest.mark.slow
def test_the_stacked_lstm_trains_on_parameter_servers_through_the_shared_step(ps_data, tmp_path):
    """Refused before the worker's step became gpupar's compiled step; now the preset's LSTM trains there too."""
    launch = Launch(["--workers=2", "--ps=1"], _flags(ps_data, tmp_path, model="lstm", lstm_units=16, lstm_layers=2,
                                                      epochs=2))
    status = launch.finish(timeout=240)
    assert status == 0, launch.output[-3000:]
    launch.assert_no_strays()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["logs"]["val_accuracy"] > 0.2  # chance is 0.1


def _chief_lines(output):
    """The chief's own lines, without the gRPC complaints about the dead worker that bury its error."""
    return "".join(line for line in output.splitlines(keepends=True) if line.startswith("[chief:0]") and not any(
        noise in line for noise in ("GRPC error information", "Error received from peer", "disconnected from the client",
                                    "Connection refused", "Failed to remove function remotely")))


USER_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "user_dataset_fn.py")


EPOCHS = 12  # the kills land in the first few epochs; the restarted cluster trains the rest


def _user_launch(args, model_dir, epochs, *extra):
    return Launch(args, [sys.executable, USER_SCRIPT, str(model_dir), str(epochs), *extra])


@pytest.mark.slow
def test_a_script_written_to_keras_guide_trains_on_parameter_servers_with_two_renames(tmp_path):
    """gpupar.strategy() first thing joins the cluster (the ps and worker tasks serve there), the chief builds and
    compiles under its scope, and gpupar.fit(model, dataset_fn, ...) trains the model as it is."""
    launch = _user_launch(["--workers=2", "--ps=1"], tmp_path / "model", 2, "guide")
    status = launch.finish(timeout=240)
    assert status == 0, _chief_lines(launch.output)[-4000:]
    launch.assert_no_strays()
    assert re.search(r"\[chief:0\] user_dataset_fn done: strategy: ParameterServerStrategy .*val_accuracy (0\.[89]|1\.0)",
                     launch.output), _chief_lines(launch.output)[-3000:]


@pytest.mark.slow
def test_a_users_script_with_its_embedding_split_over_two_ps_survives_a_killed_worker_and_a_killed_chief(tmp_path):
    model_dir = tmp_path / "model"
    launch = _user_launch(["--workers=2", "--ps=2", "--restarts=2"], model_dir, EPOCHS)
    try:
        launch.kill_when(r"\[chief:0\] Epoch:\[0\] loss:.*val_accuracy", "worker:1", timeout=180)  # re-run
        launch.wait_for(r"worker:1 ended with status -9; restarting it", timeout=60)
        # Then the chief: the whole cluster starts again.
        saved = launch.kill_when(r"\[chief:0\] Epoch:\[(\d+)\] loss:.*saved \S+ckpt-\d+", "chief:0")
        status = launch.finish(timeout=300)
    finally:
        launch.kill_all()
    assert status == 0, _chief_lines(launch.output)[-6000:]
    launch.assert_no_strays()
    out = launch.output
    assert "restarting the cluster with the same command" in out
    assert len(task_pids(out)["worker:1"]) == 3  # started, restarted alone after its kill, restarted with the cluster
    resumed = re.search(r"\[chief:0\] resumed from \S+ckpt-(\d+) after (\d+) epoch\(s\)", out)
    assert resumed and int(resumed[1]) >= int(saved[1]) + 1, out[-3000:]  # from its last checkpoint, or later
    assert "[chief:0] variable sequential/embed/embeddings (8192, 16) in 2 shards, on ps:0, ps:1" in out
    assert "[chief:0] evaluation: on the chief, reading the variables from the ps tasks" in out
    metrics = json.loads((model_dir / "metrics.json").read_text())
    history = metrics["history"]
    assert [r["epoch"] for r in history] == list(range(EPOCHS)) and all(r["steps"] == 32 for r in history)  # none lost
    assert history[-1]["logs"]["loss"] < 0.5 * history[0]["logs"]["loss"]
    assert metrics["logs"]["val_accuracy"] > 0.9  # chance is about 0.5
    # The split embedding was saved in slices of one tensor: an unsplit model restores it.
    weights = float(re.search(r"user_dataset_fn done: .*weights (\S+)", out)[1])
    import keras
    import tensorflow as tf

    model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(8192, 16),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2)])
    tf.train.Checkpoint(model=model).restore(str(model_dir / f"ckpt-{EPOCHS}")).expect_partial()
    assert sum(float(w.sum()) for w in model.get_weights()) == pytest.approx(weights, abs=1e-3)


def test_arrays_for_parameter_servers_are_refused_naming_dataset_fn(tmp_path):
    """The chief of a cluster from TF_CONFIG refuses before it joins: no other task need run (ports no one serves)."""
    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2", "localhost:3"], "ps": ["localhost:4"]}
    done = subprocess.run(
        [sys.executable, USER_SCRIPT, str(tmp_path / "model"), "1", "arrays"], capture_output=True, text=True,
        timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                          "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}})})
    assert done.returncode == 1, done.stderr[-3000:]
    assert re.search(r"gpupar.errors.GpuparError: strategy=parameter_server needs x as a "
                     r"dataset_fn\(input_context\), not arrays", done.stderr), done.stderr[-3000:]
    assert "strategy:" not in done.stdout + done.stderr  # refused before the chief joined the cluster
    assert not os.path.exists(tmp_path / "model" / "checkpoint")


def test_the_coordinator_reads_no_metric_variable_while_calls_are_in_flight():
    """Under load an eager read of the ps tasks' metric variables from the coordinator, while workers' calls ran, has
    crashed it (SIGSEGV): the scheduler gives the metrics its workers read, and reads them itself only when idle."""
    import contextlib

    from gpupar.training.inner_loop import Results
    from gpupar.training.modes.parameter_server import Scheduler
    from gpupar.training.steps.step import Step as AnyStep

    reads = []

    class Model:
        def get_metrics_result(self):
            reads.append(len(scheduler.pending))
            return {"loss": 0.25}

    class Step(AnyStep):
        model = Model()
        train_zeros = staticmethod(lambda: 0.0)
        train_step = staticmethod(lambda batch, states: (0.0, states))
        in_call = staticmethod(contextlib.nullcontext)

        @staticmethod
        def results(num_steps, totals, waited, busy):
            return Results(num_steps, float(totals), float(num_steps))

    class Remote:
        def __init__(self, number):
            self.number = number

        def fetch(self):  # a worker's (totals, worker index, metrics), its metrics as it read them
            return float(self.number), self.number % 2, {"loss": 1.0 / self.number}

    class Coordinator:
        scheduled = 0

        def schedule(self, function, args):
            self.scheduled += 1
            return Remote(self.scheduled)

        def join(self):
            pass

    scheduler = Scheduler(Coordinator(), Step(), strategy=None, num_workers=1)  # 2 calls in flight at most
    assert scheduler.run(None, 1).steps == 0 and scheduler.run(None, 1).steps == 0
    assert scheduler.metrics() == {}  # nothing fetched yet: no read of the variables either
    assert scheduler.run(None, 1).steps == 1  # the third waits for the first
    assert scheduler.metrics() == {"loss": 1.0}
    assert scheduler.run(None, 1).steps == 1
    assert scheduler.metrics() == {"loss": 0.5} and reads == []
    assert scheduler.finish().steps == 2
    assert scheduler.metrics() == {"loss": 0.25} and reads == [0]  # read here, with nothing in flight
