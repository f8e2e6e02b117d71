"""The presets: ready-made runs of gpupar.fit (the MNIST ConvNet and LSTM), with their own options."""
