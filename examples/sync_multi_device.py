"""Synchronous multi-device training: MirroredStrategy, and central storage (variables on the CPU).

    python examples/sync_multi_device.py            # TF1: towers + average_gradients
    python examples/sync_multi_device.py --quick    # a few steps, as the tests run it

Mirrored: a copy of the variables per device, gradients all-reduced. Central storage: one copy
on /cpu:0 (the TF1 "parameter server on the CPU" towers), compute on every device. On a machine
with two GPUs, drop virtual_cpus: the strategies then run on the GPUs.
"""

import sys

import gpupar

quick = "--quick" in sys.argv
for strategy in ("mirrored", "central_storage"):
    result = gpupar.fit_mnist(
        strategy=strategy,
        dataset="fashion_mnist",
        data_dir="/usr/share/datasets/fashion-mnist",  # omit to download MNIST with TFDS
        virtual_cpus=2,  # two logical CPU devices stand in for two GPUs
        epochs=1,
        steps_per_epoch=5 if quick else None,
        per_replica_batch_size=128 if quick else 1024,
    )
    print(f"{strategy}: {result.replicas} replicas, global batch {result.global_batch}, "
          f"test accuracy {result.test_accuracy:.4f}")
