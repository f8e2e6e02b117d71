"""The ceiling for a training step: its FLOPs, and this machine's matrix-multiply rate."""

import math
import time

import numpy as np
import tensorflow as tf
# Private, as nothing public offers them: the per-op FLOP statistics TensorFlow registers (for
# MatMul, BatchMatMul, Conv2D and its backprops, DepthwiseConv2dNative).
from tensorflow.python.framework import ops


def _registered(op) -> float:
    """TensorFlow's own count for the op (registered by its profiler's flops_registry on `import tensorflow`)."""
    return ops.get_stats_for_node_def(op.graph, op.node_def, "flops").value


def _dims(tensor) -> list:
    return tensor.shape.as_list()


def _batch_matmul(op) -> float:
    """2 x the output's size x the contracted length, which is the first operand's rows if adj_x.

    TensorFlow's registered statistic reads a transpose_a attribute, which BatchMatMul has not
    (it has adj_x), and so counts a weight gradient's x^T @ dy with the wrong length.
    """
    a = _dims(op.inputs[0])
    return 2.0 * math.prod(_dims(op.outputs[0])) * a[-2 if op.get_attr("adj_x") else -1]


def _einsum(op) -> float:
    """2 x the product of every index's size (the ellipsis' dims broadcast): a naive contraction's multiply-adds."""
    inputs = op.get_attr("equation").decode().split("->")[0].split(",")
    if len(inputs) < 2:  # a transpose, trace or sum of one operand: no products
        return 0.0
    sizes, ellipses = {}, []
    for labels, operand in zip(inputs, op.inputs):
        shape = _dims(operand)
        if "..." in labels:
            before, after = labels.split("...")
            ellipses.append(shape[len(before):len(shape) - len(after)])
            labels, shape = before + after, shape[:len(before)] + shape[len(shape) - len(after):]
        sizes.update(zip(labels, shape))
    return 2.0 * math.prod(sizes.values()) * math.prod(np.broadcast_shapes(*map(tuple, ellipses)) if ellipses else ())


def _convolution(out_position: int, filter_position: int, depthwise: bool):
    """A convolution's or backprop's 2 x (forward output size) x (filter size per output channel).

    out_position names the forward convolution's output (an output -n-1 is the op's output n, an
    input n >= 0 its out_backprop); filter_position likewise the filter or, for a filter backprop,
    its gradient. Per output element a convolution does one multiply-add per filter element of
    its output channel (kh x kw x in-channels per group), a depthwise one kh x kw.
    """
    def flops(op) -> float:
        pick = lambda position: op.outputs[-position - 1] if position < 0 else op.inputs[position]
        kernel = _dims(pick(filter_position))
        per_output = math.prod(kernel[:-2]) if depthwise else math.prod(kernel[:-1])
        return 2.0 * math.prod(_dims(pick(out_position))) * per_output
    return flops


# The ops a matrix unit runs, and how each is counted: TensorFlow's registered statistic where it
# has one, else the shape arithmetic above.
MATRIX_OPS = {
    **dict.fromkeys(("MatMul", "Conv2D", "Conv3D", "DepthwiseConv2dNative"), _registered),
    "Conv2DBackpropInput": _convolution(2, 1, depthwise=False),
    "Conv2DBackpropFilter": _convolution(2, -1, depthwise=False),
    **dict.fromkeys(("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"), _batch_matmul),
    "Einsum": _einsum,
    "Conv3DBackpropInputV2": _convolution(2, 1, depthwise=False),
    "Conv3DBackpropFilterV2": _convolution(2, -1, depthwise=False),
    "DepthwiseConv2dNativeBackpropInput": _convolution(2, 1, depthwise=True),
    "DepthwiseConv2dNativeBackpropFilter": _convolution(2, -1, depthwise=True),
}
# Ops that call functions once per loop iteration, or one of several branches.
_LOOPS = ("While", "StatelessWhile")
_BRANCHES = ("If", "StatelessIf", "Case", "StatelessCase")


def step_flops_per_example(model, batch) -> float:
    """FLOPs of the matrix ops in one call of `model.train_step(batch)`, per example of the batch.

    The step (Keras' own train_step or a model's override, such as a GAN's two updates) is traced
    with tf.function at the batch's shapes, not run, and every matrix op of the graph counted
    (MATRIX_OPS: multiply, batched multiply, einsum, convolutions and their backprops), a
    multiply-add as 2 FLOPs: TensorFlow's registered statistic for MatMul, Conv2D, Conv3D and
    DepthwiseConv2dNative; shape arithmetic for BatchMatMul* (TensorFlow's ignores adj_x),
    Einsum and every convolution backprop (TensorFlow's Conv2D backprops count from the input
    image's size, not the output's: too many for "valid" padding; a backprop does the forward
    convolution's multiply-adds).
    Batch norm, activations, pooling, the loss and the optimizer's update are element-wise and
    memory-bound, and left out: the count is what a matrix unit could do at best.

    Only ops something needs are counted: those the step's outputs or its side effects (variable
    updates) depend on. The gradient of the model's input, which TensorFlow builds with each
    first layer's gradient and nothing reads, is not.

    Ops inside function bodies are counted too: calls (PartitionedCall and the like) once, If
    and Case the costliest branch, and a While (Keras' RNNs on CPU, and their gradients) its
    body times the trip count and its condition one time more. The trip count is the loop's
    maximum_iterations, folded from the constants it is computed from (the time dimension, for
    Keras' RNNs: their loop runs to `time < time_steps` with maximum_iterations the time steps,
    and a While's gradient loop runs as many iterations as the forward loop, bound by the same
    tensor). A loop with no maximum_iterations, or one that depends on the data, raises ValueError.

    Precondition: the model is built and its optimizers too (the step must create no variables),
    most simply by having fit it for one step.

    Args:
      model: A keras.Model.
      batch: One batch as train_step receives it (e.g. an (x, y) tuple, or images alone for a GAN);
        arrays or tensors, of which the first's leading dimension is the number of examples.

    Returns:
      The step's FLOPs divided by the batch's number of examples.
    """
    specs = tf.nest.map_structure(lambda x: tf.TensorSpec.from_tensor(tf.convert_to_tensor(x)), batch)
    graph = tf.function(model.train_step).get_concrete_function(specs).graph
    return _graph_flops(graph, {}) / tf.nest.flatten(specs)[0].shape[0]


def _graph_flops(graph, bound) -> float:
    """The FLOPs of the graph's needed matrix ops and, recursively, of the functions its ops call.

    bound maps the names of the graph's placeholders (a function body's arguments) to a
    function giving their value, from the caller's graph, for folding a nested loop's trip count.
    """
    total = 0.0
    for op in _needed_ops(graph):
        if op.type in MATRIX_OPS:
            total += MATRIX_OPS[op.type](op)
        bodies = {name: _bodies_flops(op, name, bound) for name in _called_functions(op)}
        if op.type in _LOOPS:
            trips = _folded(op.inputs[1], bound)  # while_v2's loop variables: counter, maximum_iterations, ...
            if trips < 0:
                raise ValueError(f"{op.name} has no maximum_iterations: its trip count is unknown until it runs")
            total += trips * sum(bodies["body"]) + (trips + 1) * sum(bodies["cond"])
        elif op.type in _BRANCHES:
            total += max(sum(bodies.values(), []), default=0.0)
        else:
            total += sum(sum(bodies.values(), []))
    return total


def _needed_ops(graph) -> list:
    """The graph's ops its outputs or control outputs (stateful ops that must run) depend on."""
    needed, pending = set(), [t.op for t in graph.outputs] + list(graph.control_outputs)
    while pending:
        op = pending.pop()
        if op not in needed:
            needed.add(op)
            pending.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return [op for op in graph.get_operations() if op in needed]


def _called_functions(op) -> list:
    """Names of the op's function-valued attributes: a While's body and cond, an If's branches, a call's f."""
    return [name for name, value in op.node_def.attr.items() if value.HasField("func") or value.list.func]


def _bodies_flops(op, attribute: str, bound) -> list:
    """The FLOPs of one run of each function in the op's attribute, in the graph TensorFlow traced it as.

    A While or a call passes all its inputs to its functions, If and Case all but the first (the
    condition or branch index). Each body's arguments are bound to the op's inputs, for folding.
    """
    arguments = op.inputs[1:] if op.type in _BRANCHES else op.inputs
    value = op.node_def.attr[attribute]
    counts = []
    for function in [value.func] if value.HasField("func") else value.list.func:
        body = _traced_graph(op.graph, function.name)
        arguments_values = {p.name: (lambda t=t: _folded(t, bound)) for p, t in zip(body.inputs, arguments)}
        counts.append(_graph_flops(body, arguments_values))
    return counts


def _traced_graph(graph, name: str):
    """The FuncGraph of a function an op of the graph calls, from the graph's (or an outer graph's) library.

    The traced graph, not one rebuilt from the FunctionDef: that would lose the shapes of the
    variables the body reads, and with them its matrix ops' shapes. Graph._get_function is
    private but the only way from a function's name back to its graph.
    """
    while graph._get_function(name) is None:
        graph = graph.outer_graph
    return graph._get_function(name).graph


def _folded(tensor, bound) -> int:
    """The value of a scalar computed from constants (and bound arguments) alone, run in a graph of its own.

    tf.get_static_value folds only some ops (not Keras' reduce_max of the time steps), so the
    ops the tensor depends on are copied into a new graph and run there, the bound placeholders fed.
    """
    needed, pending = {}, [tensor.op]
    while pending:
        op = pending.pop()
        if op.name not in needed:
            needed[op.name] = op
            pending.extend([t.op for t in op.inputs] + list(op.control_inputs))
    unbound = [name for name, op in needed.items() if op.type == "Placeholder" and op.outputs[0].name not in bound]
    if unbound:
        raise ValueError(f"{tensor.name} depends on {unbound}: a loop's trip count that depends on the data")
    graph_def = tf.compat.v1.GraphDef()
    graph_def.node.extend(op.node_def for op in needed.values())
    with tf.Graph().as_default() as graph:
        tf.import_graph_def(graph_def, name="")
    feeds = {graph.get_tensor_by_name(name): value() for name, value in bound.items()
             if name.split(":")[0] in needed}
    with tf.compat.v1.Session(graph=graph) as session:
        return int(session.run(tensor.name, feeds))


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
