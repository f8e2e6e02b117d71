"""Synchronous training on two worker processes (MultiWorkerMirroredStrategy) on loopback."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import gpupar
from launching import Launch

ATOL = 1e-5  # as in test_train: reordered float32 sums only


def _state(checkpoint):
    """Every variable in a checkpoint: weights, batch-norm statistics, Adam's moments, counters."""
    reader = tf.train.load_checkpoint(checkpoint)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(checkpoint)
            if name.endswith("VARIABLE_VALUE")}


@pytest.mark.slow
def test_two_workers_reach_the_weights_of_two_replicas_in_one_process(shared_idx_dir, tmp_path):
    common = dict(data_dir=shared_idx_dir, epochs=1, steps_per_epoch=4, batch_size=16, dropout=0.0,
                  sync_batch_norm=True, seed=0, display_step=100)
    launch = Launch(["--workers=2"], [f"--{k}={v}" for k, v in common.items()] + [
        "--strategy=multi_worker_mirrored", f"--model_dir={tmp_path / 'two_workers'}",
        f"--metrics_json={tmp_path / 'metrics.json'}"])
    one = gpupar.fit_mnist(strategy="mirrored", virtual_cpus=2, model_dir=str(tmp_path / "one_process"), **common)
    assert launch.finish(timeout=180) == 0, launch.output[-3000:]
    launch.assert_no_strays()
    out = launch.output
    assert "[worker:0] strategy: MultiWorkerMirroredStrategy on 2 workers x /cpu:0 (2 replicas)" in out
    assert "[worker:0] Epoch:[0] train loss" in out and "[worker:1] Epoch:[0] train loss" in out

    workers = _state(str(tmp_path / "two_workers" / "ckpt-1"))
    single = _state(one.checkpoint)
    assert one.replicas == 2 and workers.keys() == single.keys() and len(workers) > 40
    difference = max(float(np.max(np.abs(workers[k] - single[k]))) for k in workers)
    assert difference < ATOL, difference
    keras.utils.set_random_seed(0)
    initial = gpupar.build_convnet(0.0, seed=0).get_weights()
    moved = max(float(np.max(np.abs(w - w0))) for w, w0 in zip(one.model.get_weights(), initial))
    assert moved > 100 * ATOL  # training really changed the weights
    # Only the chief keeps files: one checkpoint series, and the non-chief's scratch folder is gone.
    assert sorted(os.listdir(tmp_path / "two_workers")) == [".gpupar.lock", "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index"]
    assert "saved /tmp/gpupar-worker1-" in out
    scratch = out.split("saved /tmp/gpupar-worker1-")[1].split("/")[0]
    assert not os.path.exists(f"/tmp/gpupar-worker1-{scratch}")
    assert (tmp_path / "metrics.json").exists()
