"""The classic TF1 multi-device "tower" code, as the benchmark's baseline.

The code gpupar's users copy today: a tf.compat.v1 graph with one copy of the ConvNet (a tower)
per device, the variables on /cpu:0, each tower's gradients averaged on /cpu:0 and one Adam
update, batch norm by the fused kernel on feature maps (moments on the dense layer) with the moving
statistics from the first tower, the batches fed from NumPy by feed_dict, TensorFlow's default
thread pools, and on a machine without GPUs one CPU device per tower (ConfigProto.device_count).
The same layers, initial scale, dropout and weight penalty (build_convnet's defaults, imported
from gpupar.models.convnet), optimizer and batch as gpupar.build_convnet. It lives in a graph of its own,
so it leaves eager TensorFlow alone.
"""

from typing import List

import numpy as np
import tensorflow as tf

from gpupar.models.convnet import BN_MOMENTUM, DROPOUT, L2, NUM_CLASSES

tf1 = tf.compat.v1


def tower_devices(towers: int, num_gpus: int) -> List[str]:
    """One device per tower: the GPUs where there are enough, otherwise CPU devices."""
    if num_gpus >= towers:
        return [f"/gpu:{i}" for i in range(towers)]
    return [f"/cpu:{i}" for i in range(towers)]


def _batch_norm(x, name, updates):
    """Training-mode batch norm (fused kernel for feature maps, moments for vectors), as tf.layers did."""
    channels = x.shape[-1]
    with tf1.variable_scope(name, reuse=tf1.AUTO_REUSE), tf.device("/cpu:0"):
        gamma = tf1.get_variable("gamma", [channels], initializer=tf1.ones_initializer())
        beta = tf1.get_variable("beta", [channels], initializer=tf1.zeros_initializer())
        moving_mean = tf1.get_variable("moving_mean", [channels], initializer=tf1.zeros_initializer(), trainable=False)
        moving_var = tf1.get_variable("moving_variance", [channels], initializer=tf1.ones_initializer(),
                                      trainable=False)
    if len(x.shape) == 4:
        y, mean, variance = tf1.nn.fused_batch_norm(x, gamma, beta, epsilon=1e-3, is_training=True)
    else:
        mean, variance = tf.nn.moments(x, [0])
        y = tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-3)
    if updates is not None:  # the first tower's statistics, as the classic code kept them
        updates += [tf1.assign(moving_mean, moving_mean * BN_MOMENTUM + mean * (1 - BN_MOMENTUM)),
                    tf1.assign(moving_var, moving_var * BN_MOMENTUM + variance * (1 - BN_MOMENTUM))]
    return y


def _tower_loss(images, labels, updates):
    """The ConvNet's mean cross-entropy plus its L2 weight penalty on one tower's batch."""
    init = tf1.truncated_normal_initializer(stddev=0.01)
    with tf1.variable_scope("convnet", reuse=tf1.AUTO_REUSE), tf.device("/cpu:0"):
        kernels = [tf1.get_variable("conv1", [5, 5, 1, 6], initializer=init),
                   tf1.get_variable("conv2", [5, 5, 6, 12], initializer=init),
                   tf1.get_variable("dense1", [7 * 7 * 12, 100], initializer=init),
                   tf1.get_variable("dense2", [100, NUM_CLASSES], initializer=init)]
        bias = tf1.get_variable("dense2_bias", [NUM_CLASSES], initializer=tf1.zeros_initializer())
    h = images
    for i, kernel in enumerate(kernels[:2]):
        h = tf.nn.conv2d(h, kernel, 1, "SAME")
        h = tf.nn.max_pool2d(tf.nn.relu(_batch_norm(h, f"bn{i + 1}", updates)), 2, 2, "VALID")
    h = tf.matmul(tf.reshape(h, [-1, 7 * 7 * 12]), kernels[2])
    h = tf1.nn.dropout(tf.nn.relu(_batch_norm(h, "bn3", updates)), rate=DROPOUT)
    logits = tf.matmul(h, kernels[3]) + bias
    cross_entropy = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    return cross_entropy + L2 * tf.add_n([tf.nn.l2_loss(k) * 2 for k in kernels])


class TowerTrainer:
    """A session training the ConvNet on `towers` devices, a global batch of towers x batch_size per step.

    step(images, labels) feeds one global batch (NumPy, NHWC float32 in [0, 1]) and returns the
    mean loss over the towers.
    """

    def __init__(self, towers: int, batch_size: int, num_gpus: int = 0, seed: int = 0):
        self.graph = tf.Graph()
        self.devices = devices = tower_devices(towers, num_gpus)
        with self.graph.as_default():
            tf1.set_random_seed(seed)
            self.images = tf1.placeholder(tf.float32, [towers * batch_size, 28, 28, 1])
            self.labels = tf1.placeholder(tf.int64, [towers * batch_size])
            optimizer = tf1.train.AdamOptimizer(1e-3, epsilon=1e-7)  # Keras' epsilon
            losses, gradients, updates = [], [], []
            for i, device in enumerate(devices):
                share = slice(i * batch_size, (i + 1) * batch_size)
                with tf.device(device):
                    loss = _tower_loss(self.images[share], self.labels[share], updates if i == 0 else None)
                    losses.append(loss)
                    gradients.append(optimizer.compute_gradients(loss))
            with tf.device("/cpu:0"):
                averaged = [(tf.add_n([g[k][0] for g in gradients]) / towers, gradients[0][k][1])
                            for k in range(len(gradients[0]))]
                with tf.control_dependencies(updates):
                    self.train_op = optimizer.apply_gradients(averaged)
                self.loss = tf.add_n(losses) / towers
            self.num_parameters = sum(int(np.prod(v.shape)) for v in tf1.trainable_variables())
            config = tf1.ConfigProto(device_count={"CPU": max(1, sum(d.startswith("/cpu") for d in devices))})
            self.session = tf1.Session(graph=self.graph, config=config)
            self.session.run(tf1.global_variables_initializer())

    def step(self, images: np.ndarray, labels: np.ndarray) -> float:
        _, loss = self.session.run([self.train_op, self.loss], {self.images: images, self.labels: labels})
        return float(loss)
