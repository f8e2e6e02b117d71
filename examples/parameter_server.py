"""Asynchronous training: ParameterServerStrategy, a coordinator, workers and a parameter server.

    python examples/parameter_server.py            # 2 workers + 1 ps on this machine, 2 epochs
    python examples/parameter_server.py --quick    # a few steps, as the tests run it

The chief (coordinator) builds the model under strategy.scope(), which puts every variable on
the ps task, and schedules train steps onto the workers; each worker applies its own gradients
without waiting for the other (TF1's between-graph replication with tf.train.replica_device_setter).
The worker and ps processes only serve. gpupar's launcher starts the four processes on 127.0.0.1;
on real machines each runs `gpupar --strategy=parameter_server ...` with its own TF_CONFIG.
"""

import json
import sys
import tempfile

from gpupar.runtime.launch import launch

quick = "--quick" in sys.argv
run_dir = tempfile.mkdtemp(prefix="gpupar-parameter-server-")
flags = [
    "--strategy=parameter_server",
    "--dataset=fashion_mnist",
    "--data_dir=/usr/share/datasets/fashion-mnist",  # omit to download MNIST with TFDS
    f"--epochs={1 if quick else 2}",
    f"--model_dir={run_dir}/model",
    f"--metrics_json={run_dir}/metrics.json",
    *(["--steps_per_epoch=10", "--display_step=5", "--per_replica_batch_size=128"] if quick else []),
]
WORKERS = 2
status = launch(workers=WORKERS, ps=1, restarts=0, args=flags)  # the chief's log shows the updates of each worker
if status:
    sys.exit(status)
metrics = json.load(open(f"{run_dir}/metrics.json"))
print(f"parameter server: {WORKERS} workers, each step on one of them, batch {metrics['global_batch']} per step, "
      f"test accuracy {metrics['logs']['val_accuracy']:.4f}")
