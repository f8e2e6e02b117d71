"""gpupar's benchmarks: scripts run from a clone of the repository, not installed with the package.

    python -m benchmarks.bench          # gpupar against Keras model.fit and the TF1 tower code (make bench)
    python -m benchmarks.input          # augmentation on the host against on the device
    python -m benchmarks.pipeline       # model parallelism: micro-batches and devices

Results and what they show: benchmarks/README.md.
"""
