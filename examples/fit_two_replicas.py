"""Synchronous data parallelism through the Python API: two replicas, checkpoints, TensorBoard.

    python examples/fit_two_replicas.py                 # 2 epochs on Fashion-MNIST
    python examples/fit_two_replicas.py --quick         # a few steps, as the tests run it

On a machine with two GPUs, drop virtual_cpus: strategy="auto" then mirrors over the GPUs.
"""

import sys
import tempfile

import gpupar

quick = "--quick" in sys.argv
run_dir = tempfile.mkdtemp(prefix="gpupar-example-")
result = gpupar.fit_mnist(
    dataset="fashion_mnist",
    data_dir="/usr/share/datasets/fashion-mnist",  # Debian's dataset-fashion-mnist; omit to download MNIST
    virtual_cpus=2,  # two logical CPU devices stand in for two GPUs
    epochs=1 if quick else 2,
    steps_per_epoch=5 if quick else None,
    model_dir=f"{run_dir}/checkpoints",  # ckpt-N after every epoch; resume=True continues
    log_dir=f"{run_dir}/tensorboard",  # tensorboard --logdir <this>
)
print(f"{result.replicas} replicas, global batch {result.global_batch}, "
      f"test accuracy {result.test_accuracy:.4f}, checkpoints in {run_dir}/checkpoints")
