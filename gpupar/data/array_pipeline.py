"""The tf.data pipelines of in-memory arrays: endless seeded training batches, and a whole evaluation set."""

import math

import numpy as np
import tensorflow as tf

from gpupar.errors import GpuparError


def options(deterministic=True, threads=None):
    """tf.data options for gpupar's pipelines: DATA auto-sharding, the order, a private thread pool."""
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


def train_dataset(arrays, global_batch: int, seed: int, start_step: int = 0, transform=None, host_transform=None,
                  num_parallel_calls=None, deterministic: bool = True, threads=None) -> tf.data.Dataset:
    """Endless training batches of in-memory arrays: each pass over them is a fresh permutation.

    `arrays` is a structure (a tuple such as (x, y) or (x, y, sample_weight), whose parts may be
    dicts or tuples) of arrays with one row per example. The permutation of pass p depends only
    on (seed, p), so a run resumed at `start_step` sees the same batches as one that never
    stopped. The arrays stay in memory as they are (the cache); `transform` maps each batch after
    it is drawn; `host_transform(example, pass_number, position)` instead maps each example on
    the host before batching (the classic per-image augmentation). `num_parallel_calls` None
    lets tf.data tune the parallelism; `deterministic` False lets a ready element overtake a slow
    one, so the order (and, with a host transform, which examples share a batch) may change, and a
    resumed run may see a batch twice and miss another.
    """
    arrays = tf.nest.map_structure(tf.constant, arrays)
    num_examples = int(tf.nest.flatten(arrays)[0].shape[0])
    per_pass = batches_per_epoch(num_examples, global_batch)
    first_pass, skip = divmod(start_step, per_pass)
    parallel = tf.data.AUTOTUNE if num_parallel_calls is None else num_parallel_calls

    def order(number):
        return tf.random.experimental.stateless_shuffle(
            tf.range(num_examples), seed=tf.stack([tf.constant(seed, tf.int64), number])
        )[: per_pass * global_batch]

    def gather(index):
        return tf.nest.map_structure(lambda array: tf.gather(array, index), arrays)

    passes = tf.data.Dataset.range(first_pass, np.iinfo(np.int64).max)
    if host_transform is not None:
        # The classic way: a map over single examples, each transformed on the CPU.
        def examples(number):
            positions = tf.range(per_pass * global_batch, dtype=tf.int64)
            return tf.data.Dataset.from_tensor_slices((order(number), positions)).map(
                lambda index, position: (number, position, index))

        def one(number, position, index):
            return host_transform(gather(index), number, position)

        ds = passes.flat_map(examples).skip(skip * global_batch).map(one, num_parallel_calls=parallel)
        ds = ds.batch(global_batch, drop_remainder=True)
    else:
        ds = passes.flat_map(
            lambda number: tf.data.Dataset.from_tensor_slices(order(number)).batch(global_batch, drop_remainder=True))
        ds = ds.skip(skip).map(lambda index: _applied(transform, gather(index)), num_parallel_calls=parallel)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(options(deterministic, threads))


def _applied(transform, batch):
    return batch if transform is None else transform(*batch)


def eval_dataset(arrays, global_batch: int, transform=None) -> tf.data.Dataset:
    """The whole of the arrays in order, last partial batch included, repeated for one iterator per run."""
    ds = tf.data.Dataset.from_tensor_slices(arrays).batch(global_batch)
    ds = ds.map(lambda *batch: _applied(transform, batch), num_parallel_calls=tf.data.AUTOTUNE).cache().repeat()
    return ds.prefetch(tf.data.AUTOTUNE).with_options(options())


def test_steps(num_examples: int, global_batch: int) -> int:
    """Batches in one pass over an evaluation set, the partial one included."""
    return math.ceil(num_examples / global_batch)
