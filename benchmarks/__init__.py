"""gpupar's benchmarks: scripts run from a clone of the repository, not installed with the package.

    python -m benchmarks.bench          # gpupar against Keras model.fit and the TF1 tower code (make bench)
    python -m benchmarks.input          # augmentation on the host against on the device
    python -m benchmarks.pipeline       # model parallelism: micro-batches and devices
    python -m benchmarks.versus_fit     # gpupar.fit against model.fit on a user's CNN, accuracy per epoch
    python -m benchmarks.keras_io       # gpupar.fit against model.fit on five keras-io programs, float32 and bfloat16
    python -m benchmarks.own_step       # a GAN's own train_step: gpupar.fit against model.fit
    python -m benchmarks.results        # all of the above that the docs quote, and make train's run (make results)

Results and what they show: benchmarks/README.md.
"""
