"""The tf.data input pipelines: endless seeded training batches and the whole test set."""

import math

import numpy as np
import tensorflow as tf

from gpupar.data import augment
from gpupar.errors import GpuparError


def _normalise(images, labels):
    """uint8 (B, 28, 28) -> float32 (B, 28, 28, 1) in [0, 1]."""
    return tf.cast(images, tf.float32)[..., tf.newaxis] / 255.0, labels


def _options(deterministic=True, threads=None):
    options = tf.data.Options()
    # The data sit in memory and are batched by the global batch: the strategy splits each
    # batch across replicas (and, on several workers, each worker keeps its share of batches).
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    options.deterministic = deterministic
    if threads is not None:
        # A pool of its own keeps the input work from queueing behind the train step's ops.
        options.threading.private_threadpool_size = threads
    return options


def batches_per_epoch(num_examples: int, global_batch: int) -> int:
    """Full global batches in one pass over the training set."""
    if num_examples < global_batch:
        raise GpuparError(
            f"the training set has {num_examples} examples, fewer than one global batch of "
            f"{global_batch}; lower batch_size"
        )
    return num_examples // global_batch


def train_dataset(images, labels, global_batch: int, seed: int, start_step: int = 0, augment_on_host: bool = False,
                  num_parallel_calls=None, deterministic: bool = True, threads=None) -> tf.data.Dataset:
    """Endless training batches: each pass over the data is a fresh permutation.

    The permutation of pass p depends only on (seed, p), so a run resumed at `start_step` sees
    the same batches as one that never stopped. The images stay in memory as uint8 (the cache)
    and are normalised, and with augment_on_host warped one by one, after they are drawn.
    `num_parallel_calls` None lets tf.data tune the parallelism; `deterministic` False lets a
    ready element overtake a slow one, so the order (and, with host augmentation, which examples
    share a batch) may change, and a resumed run may see a batch twice and miss another.
    """
    images, labels = tf.constant(images), tf.constant(labels)
    num_examples = int(images.shape[0])
    per_pass = batches_per_epoch(num_examples, global_batch)
    first_pass, skip = divmod(start_step, per_pass)
    parallel = tf.data.AUTOTUNE if num_parallel_calls is None else num_parallel_calls

    def order(number):
        return tf.random.experimental.stateless_shuffle(
            tf.range(num_examples), seed=tf.stack([tf.constant(seed, tf.int64), number])
        )[: per_pass * global_batch]

    passes = tf.data.Dataset.range(first_pass, np.iinfo(np.int64).max)
    if augment_on_host:
        # The classic way: a map over single examples, each warped in Python on the CPU.
        def examples(number):
            positions = tf.range(per_pass * global_batch, dtype=tf.int64)
            return tf.data.Dataset.from_tensor_slices((order(number), positions)).map(
                lambda index, position: (number, position, index))

        def warp(number, position, index):
            image, label = _normalise(tf.gather(images, index), tf.gather(labels, index))
            return augment.host_affine(image, augment.host_seed(seed, number, position)), label

        ds = passes.flat_map(examples).skip(skip * global_batch).map(warp, num_parallel_calls=parallel)
        ds = ds.batch(global_batch, drop_remainder=True)
    else:
        def gather(batch):
            return _normalise(tf.gather(images, batch), tf.gather(labels, batch))

        ds = passes.flat_map(
            lambda number: tf.data.Dataset.from_tensor_slices(order(number)).batch(global_batch, drop_remainder=True))
        ds = ds.skip(skip).map(gather, num_parallel_calls=parallel)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(_options(deterministic, threads))


def test_dataset(images, labels, global_batch: int) -> tf.data.Dataset:
    """The whole test set in order, last partial batch included, repeated for one iterator per run."""
    ds = tf.data.Dataset.from_tensor_slices((images, labels)).batch(global_batch)
    ds = ds.map(_normalise, num_parallel_calls=tf.data.AUTOTUNE).cache().repeat()
    return ds.prefetch(tf.data.AUTOTUNE).with_options(_options())


def test_steps(num_examples: int, global_batch: int) -> int:
    """Batches in one pass over the test set, the partial one included."""
    return math.ceil(num_examples / global_batch)
