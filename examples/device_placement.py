"""Device placement: pin ops to devices, soft placement, and logging where ops run.

    python examples/device_placement.py           # TF1: with tf.device('/gpu:1'), ConfigProto(...)
    python examples/device_placement.py --quick   # the same; it is quick already

Without GPUs, the CPU is split into two virtual devices, and /cpu:1 stands in for /gpu:1.
"""

import gpupar

# Device settings come first: TensorFlow fixes its devices at the first op.
gpupar.configure_devices(gpupar.Config(virtual_cpus=2, soft_placement=True, log_placement=False))

import tensorflow as tf  # noqa: E402

gpus = tf.config.list_logical_devices("GPU")
second = "/gpu:1" if len(gpus) > 1 else "/cpu:1"

with tf.device("/cpu:0"):  # TF1: with tf.device('/cpu:0'): the input side of a tower
    a = tf.random.stateless_normal([256, 256], seed=(1, 2))
with tf.device(second):  # TF1: with tf.device('/gpu:1'): one tower's compute
    b = tf.matmul(a, a)
print(f"a lives on {a.device}\nb was computed on {b.device}")

# Soft placement (TF1 allow_soft_placement=True): a device that does not exist is replaced
# by one that does, instead of failing.
with tf.device("/gpu:7"):
    c = tf.reduce_sum(b)
print(f"asked for /gpu:7, ran on {c.device} (soft placement)")

# Placement logging (TF1 log_device_placement=True): TensorFlow logs every op's device.
tf.debugging.set_log_device_placement(True)
tf.add(a, 1.0)  # its placement line goes to stderr
tf.debugging.set_log_device_placement(False)
print("the device of every op after set_log_device_placement(True) is logged to stderr")
