"""Find input-bound training ("GPU memory full, GPU-Util 0%") and fix it.

    python examples/input_bound.py            # TF1: per-image augmentation in the input queue
    python examples/input_bound.py --quick

The same augmentation, first on the host (per image, in the tf.data map, as classic pipelines do
it), then on the device (batched inside the train step): diagnose shows which one bounds training.
"""

import sys

import gpupar

quick = "--quick" in sys.argv
common = dict(
    strategy="one_device",
    dataset="fashion_mnist",
    data_dir="/usr/share/datasets/fashion-mnist",  # omit to download MNIST with TFDS
    per_replica_batch_size=64 if quick else 1024,
    augment=True,
)
for placement in ("host", "device"):
    report = gpupar.diagnose_mnist(augment_on=placement, steps=4 if quick else 30, **common)
    print(f"--- augment_on={placement}\n{report.format()}")
