"""The FLOP count of a training step, checked against TensorFlow's own per-op counts and analytic ones."""

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops

from gpupar.models.convnet import build_convnet
from benchmarks.roofline import matmul_flops_per_second, step_flops_per_example

MATRIX_OPS = ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "MatMul")


def fit_one_step(model, x, y):
    """The model compiled and fit for one step on (x, y): built, with its optimizer (the count's precondition)."""
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=len(x), verbose=0)
    return model


def test_flops_match_tensorflows_counts_for_the_ops_a_step_runs():
    model = build_convnet(0.0)
    batch = 8
    images, labels = np.zeros((batch, 28, 28, 1), "float32"), np.zeros((batch, 10), "float32")

    def step(images):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(images, training=True))
        return tape.gradient(loss, model.trainable_variables)

    graph = tf.function(step).get_concrete_function(tf.TensorSpec((batch, 28, 28, 1))).graph
    # The tape also traces the gradient of the model's input, which nothing uses (Grappler drops it).
    used = [op for op in graph.get_operations() if op.type in MATRIX_OPS and op.outputs[0].consumers()]
    counted = sum(ops.get_stats_for_node_def(graph, op.node_def, "flops").value for op in used) / batch
    assert len(used) == 2 + 1 + 2 + 6  # forward, input and weight gradients of 2 convs; 3 matmuls per dense
    # Keras' whole train step (loss, L2 penalties, optimizer) adds no matrix op to the hand-written one's.
    fit_one_step(model, images, labels)
    assert step_flops_per_example(model, (images, labels)) == counted == 2_946_000


def test_a_bidirectional_lstm_counts_its_loops_time_steps():
    steps, features, units = 5, 6, 4
    model = keras.Sequential([keras.Input((steps,), dtype="int32"), keras.layers.Embedding(50, features),
                              keras.layers.Bidirectional(keras.layers.LSTM(units)), keras.layers.Dense(1)])
    x, y = np.ones((2, steps), "int32"), np.zeros((2, 1), "float32")
    fit_one_step(model, x, y)
    # Per direction and time step the forward loop's body multiplies the input by the kernel and
    # the state by the recurrent kernel: 2 * 4 * units * (features + units). The gradient loop
    # (as many steps) has for each of the two products the weights' gradient and the multiplier's
    # (the input's gradient is needed, for the embedding): twice the forward. Dense: forward,
    # weight and input gradient of 2 * (2 * units).
    lstm = 2 * steps * 2 * 4 * units * (features + units)
    assert step_flops_per_example(model, (x, y)) == 3 * lstm + 3 * 2 * 2 * units == 9_648


def test_multi_head_attention_counts_its_einsums():
    steps, width, heads, key_dim = 6, 8, 2, 4
    tokens = keras.Input((steps,), dtype="int32")
    embedded = keras.layers.Embedding(20, width)(tokens)
    attended = keras.layers.MultiHeadAttention(num_heads=heads, key_dim=key_dim)(embedded, embedded)
    model = keras.Model(tokens, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(attended)))
    x, y = np.ones((2, steps), "int32"), np.zeros((2, 1), "float32")
    fit_one_step(model, x, y)
    # Forward: query, key, value and output projections (EinsumDense), 2 * steps * width * heads *
    # key_dim each, and the scores and the weighted values, 2 * heads * steps * steps * key_dim
    # each. Every einsum's two operands need gradients (the projections' input, for the
    # embedding), so training is 3x forward. Dense as in the LSTM test.
    attention = 4 * 2 * steps * width * heads * key_dim + 2 * 2 * heads * steps * steps * key_dim
    assert step_flops_per_example(model, (x, y)) == 3 * attention + 3 * 2 * width == 12_720


def conv_then(layer):
    """A Conv2D(4, 3x3) on 8x8x3 images, then the layer; the loss on the layer's output."""
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, padding="same"), layer])
    x = np.ones((2, 8, 8, 3), "float32")
    y = np.zeros(model.compute_output_shape(x.shape), "float32")
    return fit_one_step(model, x, y), x, y


# The first Conv2D: forward and its kernel's gradient (the model's input needs none), 8*8*4 outputs of 3*3*3 MACs.
CONV = 2 * 2 * 8 * 8 * 4 * 3 * 3 * 3


def test_conv2d_transpose_counts_as_its_convolution():
    model, x, y = conv_then(keras.layers.Conv2DTranspose(5, 3, strides=2, padding="same"))
    # Each of the 8x8x4 input elements multiplies a 3x3x5 kernel slice into the 16x16x5 output;
    # forward, input and kernel gradient alike (Conv2DBackpropInput, Conv2D, Conv2DBackpropFilter).
    assert step_flops_per_example(model, (x, y)) == CONV + 3 * 2 * 8 * 8 * 4 * 3 * 3 * 5 == 96_768


def test_separable_conv2d_counts_depthwise_and_pointwise_parts():
    model, x, y = conv_then(keras.layers.SeparableConv2D(6, 3, padding="same", depth_multiplier=2))
    # Depthwise: 8x8x(4*2) outputs of 3x3 MACs; pointwise 1x1: 8x8x6 outputs of 8 MACs; each
    # forward, input and kernel gradient (the depthwise backprops are counted by shape arithmetic).
    assert step_flops_per_example(model, (x, y)) == CONV + 3 * 2 * (8 * 8 * 8 * 3 * 3 + 8 * 8 * 6 * 8) == 73_728


def test_matmul_rate_is_a_plausible_rate():
    rate = matmul_flops_per_second(tf.float32, size=256, repeats=4)
    assert 1e8 < rate < 1e14
