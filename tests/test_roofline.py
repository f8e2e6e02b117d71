"""The FLOP count of a training step, checked against TensorFlow's own per-op counts."""

import tensorflow as tf
from tensorflow.python.framework import ops

from gpupar.models.convnet import build_convnet
from benchmarks.roofline import matmul_flops_per_second, training_flops_per_example

MATRIX_OPS = ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "MatMul")


def test_flops_match_tensorflows_counts_for_the_ops_a_step_runs():
    model = build_convnet(0.0)
    batch = 8

    def step(images):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(images, training=True))
        return tape.gradient(loss, model.trainable_variables)

    graph = tf.function(step).get_concrete_function(tf.TensorSpec((batch, 28, 28, 1))).graph
    # The tape also traces the gradient of the model's input, which nothing uses (Grappler drops it).
    used = [op for op in graph.get_operations() if op.type in MATRIX_OPS and op.outputs[0].consumers()]
    counted = sum(ops.get_stats_for_node_def(graph, op.node_def, "flops").value for op in used) / batch
    assert len(used) == 2 + 1 + 2 + 6  # forward, input and weight gradients of 2 convs; 3 matmuls per dense
    assert training_flops_per_example(model) == counted == 2_946_000


def test_matmul_rate_is_a_plausible_rate():
    rate = matmul_flops_per_second(tf.float32, size=256, repeats=4)
    assert 1e8 < rate < 1e14
