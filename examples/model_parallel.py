"""Model parallelism: a stacked LSTM with one layer per device, pipelined over micro-batches.

    python examples/model_parallel.py            # TF1: with tf.device('/gpu:%d' % i) per LSTM layer
    python examples/model_parallel.py --quick    # a few steps, as the tests run it

First the classic picture: 3 LSTM layers on 3 devices, each batch in 4 micro-batches. Then the
ConvNet's convolutions and dense head on 2 devices each for 2 data-parallel replicas (4 devices).
The log names the device of every stage. On a machine with GPUs, drop virtual_cpus: the stages
then run on the GPUs.
"""

import sys

import gpupar

quick = "--quick" in sys.argv
common = dict(
    strategy="model_parallel",
    dataset="fashion_mnist",
    data_dir="/usr/share/datasets/fashion-mnist",  # omit to download MNIST with TFDS
    virtual_cpus=4,  # four logical CPU devices stand in for four GPUs
    microbatches=4,
    epochs=1,
    steps_per_epoch=3 if quick else None,
    per_replica_batch_size=128 if quick else 1024,
)
lstm = gpupar.fit_mnist(model="lstm", lstm_layers=3, devices="/cpu:0,/cpu:1,/cpu:2", **common)
convnet = gpupar.fit_mnist(model="convnet", **common)
for name, result in (("lstm", lstm), ("convnet", convnet)):
    print(f"{name}: {result.strategy_description}; test accuracy {result.test_accuracy:.4f}")
