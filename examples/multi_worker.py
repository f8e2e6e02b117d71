"""Synchronous training on several workers: MultiWorkerMirroredStrategy, one process per worker.

    python examples/multi_worker.py            # 2 workers on this machine, 2 epochs of Fashion-MNIST
    python examples/multi_worker.py --quick    # a few steps, as the tests run it

On real machines each worker runs `gpupar --strategy=multi_worker_mirrored ...` with its own
TF_CONFIG (README, "Running on several machines"). Here gpupar's launcher starts both workers on
127.0.0.1 with free ports, gives each its TF_CONFIG and prints their logs with a task prefix; the
tasks run in a network namespace of their own, so no other machine reaches their servers.
Every step all-reduces the gradients of both workers, so they hold the same weights; only the
chief (worker 0) keeps checkpoints and metrics.
"""

import json
import os
import sys
import tempfile

from gpupar.runtime.launch import launch

quick = "--quick" in sys.argv
run_dir = tempfile.mkdtemp(prefix="gpupar-multi-worker-")
flags = [
    "--strategy=multi_worker_mirrored",
    "--dataset=fashion_mnist",
    "--data_dir=/usr/share/datasets/fashion-mnist",  # omit to download MNIST with TFDS
    f"--epochs={1 if quick else 2}",
    f"--model_dir={run_dir}/model",
    f"--metrics_json={run_dir}/metrics.json",
    *(["--steps_per_epoch=5", "--display_step=5", "--per_replica_batch_size=128"] if quick else []),
]
status = launch(workers=2, ps=0, restarts=0, args=flags)  # in a private network namespace: see its log
if status:
    sys.exit(status)
metrics = json.load(open(f"{run_dir}/metrics.json"))
print(f"2 workers: {metrics['replicas']} replicas, global batch {metrics['global_batch']}, "
      f"test accuracy {metrics['logs']['val_accuracy']:.4f}; checkpoints: {sorted(os.listdir(f'{run_dir}/model'))}")
