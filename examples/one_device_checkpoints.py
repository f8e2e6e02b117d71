"""One-device MNIST training with per-epoch checkpoints, resume and TensorBoard.

    python examples/one_device_checkpoints.py            # TF1: Saver + get_checkpoint_state + FileWriter
    python examples/one_device_checkpoints.py --quick

It trains one epoch, then "restarts" and resumes to two epochs from the checkpoint.
"""

import sys
import tempfile

import gpupar

quick = "--quick" in sys.argv
run_dir = tempfile.mkdtemp(prefix="gpupar-one-device-")
common = dict(
    strategy="one_device",
    dataset="fashion_mnist",
    data_dir="/usr/share/datasets/fashion-mnist",  # omit to download MNIST with TFDS
    steps_per_epoch=5 if quick else None,
    per_replica_batch_size=128 if quick else 1024,
    model_dir=f"{run_dir}/checkpoints",  # ckpt-1, ckpt-2, ...: the state after each epoch
    log_dir=f"{run_dir}/tensorboard",  # tensorboard --logdir <this>
)
first = gpupar.fit_mnist(epochs=1, **common)
# As after a crash or a new job: the same model_dir with resume=True continues the epoch count.
second = gpupar.fit_mnist(epochs=2, resume=True, **common)
print(f"first run: epochs 0..{first.epoch[-1]}; resumed run started after {second.start_epoch} "
      f"epoch(s), test accuracy {second.test_accuracy:.4f}, checkpoints in {run_dir}/checkpoints")
