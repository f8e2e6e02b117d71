"""The ceiling for a training step: its FLOPs, and this machine's matrix-multiply rate."""

import time

import keras
import tensorflow as tf


def training_flops_per_example(model) -> float:
    """FLOPs of one example's forward and backward pass through the model's Conv2D and Dense layers.

    A multiply-add counts as 2 FLOPs. Forward is one product per layer; backward is two (the
    weights' gradient and the input's), except that nothing needs the gradient of the model's
    own input. Batch norm, activations, pooling and the optimizer are element-wise, memory-bound
    and left out, so the count is what a matrix unit could do at best.
    """
    total, first = 0.0, True
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D):
            height, width, channels_out = layer.output.shape[1:]
            kernel_h, kernel_w, channels_in, _ = layer.kernel.shape
            macs = height * width * channels_out * channels_in * kernel_h * kernel_w
        elif isinstance(layer, keras.layers.Dense):
            macs = layer.kernel.shape[0] * layer.kernel.shape[1]
        else:
            continue
        total += 2 * macs * (2 if first else 3)
        first = False
    return total


def matmul_flops_per_second(dtype=tf.float32, size: int = 2048, repeats: int = 8) -> float:
    """FLOP/s of TensorFlow's square matrix multiply here: the machine's practical compute peak."""
    a = tf.random.normal((size, size), dtype=tf.float32, seed=1)
    a = tf.cast(a, dtype)

    @tf.function
    def products(n):
        total = tf.zeros((), dtype)
        for _ in tf.range(n):
            total += tf.reduce_sum(tf.matmul(a, a)[:1, :1])  # keeps every product, reads back one number
        return total

    float(products(tf.constant(1)))  # traces, warms the kernels
    started = time.perf_counter()
    float(products(tf.constant(repeats)))
    return 2 * size**3 * repeats / (time.perf_counter() - started)
