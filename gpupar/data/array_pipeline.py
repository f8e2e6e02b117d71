"""The tf.data pipelines of in-memory arrays: endless seeded training batches, and a whole evaluation set."""

import math

import numpy as np
import tensorflow as tf



def no_autotune() -> tf.data.Options:
    """Options that turn tf.data's autotune off and change nothing else (for pipelines of the user's)."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return options


def options(deterministic=True, threads=None):
    """tf.data options for gpupar's pipelines: DATA auto-sharding, the order, no autotune, a private thread pool."""
    options = tf.data.Options()
    # Autotune's thread makes destroying an iterator wait until it next wakes (seconds, minutes
    # after many fits: every process with fits in it hung at exit). Without it AUTOTUNE maps run
    # on every core and the runs here are as fast (benchmarks/README.md).
    options.autotune.enabled = False
    # The data sit in memory and are batched by the global batch: the strategy splits each
    # batch across replicas (and, on several workers, each worker keeps its share of batches).
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    options.deterministic = deterministic
    if threads is not None:
        # A pool of its own keeps the input work from queueing behind the train step's ops.
        options.threading.private_threadpool_size = threads
    return options


def batches_per_epoch(num_examples: int, global_batch: int) -> int:
    """Global batches in one pass over the training set, a last partial one included (as Keras' fit)."""
    return math.ceil(num_examples / global_batch)


def as_tensors(arrays):
    """The structure's arrays as tensors; ragged tensors stay as they are."""
    return tf.nest.map_structure(lambda a: a if isinstance(a, tf.RaggedTensor) else tf.constant(a), arrays,
                                 expand_composites=False)


def rows(array) -> int:
    """Examples (rows) in an array, a tensor or a ragged tensor."""
    return int(array.shape[0])


def train_dataset(arrays, global_batch: int, seed: int, start_step: int = 0, example_map=None,
                  num_parallel_calls=None, deterministic: bool = True, threads=None,
                  shuffle: bool = True) -> tf.data.Dataset:
    """Endless training batches of in-memory arrays: each pass over them is a fresh permutation.

    `arrays` is a structure (a tuple such as (x, y) or (x, y, sample_weight), whose parts may be
    dicts or tuples) of arrays with one row per example. The permutation of pass p depends only
    on (seed, p), so a run resumed at `start_step` sees the same batches as one that never
    stopped; shuffle=False keeps the arrays' order. Each pass ends with a partial batch where the
    examples do not fill the last one, as in Keras' fit. The arrays stay in memory as they are (the
    cache); `example_map(example, pass_number, position)` maps each example on the host before
    batching (the classic per-image augmentation), seeded by where the example is. `num_parallel_calls` None lets tf.data tune the parallelism; `deterministic`
    False lets a ready element overtake a slow one, so the order (and, with an example_map, which
    examples share a batch) may change, and a resumed run may see a batch twice and miss another.
    """
    arrays = as_tensors(arrays)
    num_examples = rows(tf.nest.flatten(arrays)[0])
    per_pass = batches_per_epoch(num_examples, global_batch)
    first_pass, skip = divmod(start_step, per_pass)
    parallel = tf.data.AUTOTUNE if num_parallel_calls is None else num_parallel_calls

    def order(number):
        if not shuffle:
            return tf.range(num_examples)
        return tf.random.experimental.stateless_shuffle(
            tf.range(num_examples), seed=tf.stack([tf.constant(seed, tf.int64), number]))

    def gather(index):
        return tf.nest.map_structure(lambda array: tf.gather(array, index), arrays)

    passes = tf.data.Dataset.range(first_pass, np.iinfo(np.int64).max)
    if example_map is not None:
        # The classic way: a map over single examples, each transformed on the CPU; a pass's
        # examples are batched within the pass, the examples of skipped batches never drawn.
        def one_pass(number):
            start = tf.where(number == first_pass, tf.cast(skip * global_batch, tf.int64), tf.constant(0, tf.int64))
            positions = tf.range(num_examples, dtype=tf.int64)
            examples = tf.data.Dataset.from_tensor_slices((order(number), positions)).skip(start)
            return _batched(examples.map(lambda index, position: example_map(gather(index), number, position),
                                         num_parallel_calls=parallel), global_batch, num_examples)

        ds = passes.flat_map(one_pass)
    else:
        ds = passes.flat_map(lambda number: _batched(tf.data.Dataset.from_tensor_slices(order(number)), global_batch,
                                                     num_examples))
        ds = ds.skip(skip).map(gather, num_parallel_calls=parallel)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(options(deterministic, threads))


def eval_dataset(arrays, global_batch: int) -> tf.data.Dataset:
    """The whole of the arrays once, in order, last partial batch included, cached: repeat it for one iterator per run."""
    arrays = as_tensors(arrays)
    ds = _batched(tf.data.Dataset.from_tensor_slices(arrays), global_batch, rows(tf.nest.flatten(arrays)[0])).cache()
    return ds.with_options(options())


def _batched(examples: tf.data.Dataset, global_batch: int, num_examples: int) -> tf.data.Dataset:
    """examples.batch(global_batch), the batch dimension static where every batch of a pass is full.

    Keras' array adapter gives full batches a static first dimension too. Unknown, it costs a
    recurrent layer's loops extra Shape, BroadcastGradientArgs, Sum and Reshape ops at every
    time step, forward and backward. drop_remainder drops nothing here: the examples fill every
    batch.
    """
    return examples.batch(global_batch, drop_remainder=num_examples % global_batch == 0)


def test_steps(num_examples: int, global_batch: int) -> int:
    """Batches in one pass over an evaluation set, the partial one included."""
    return math.ceil(num_examples / global_batch)
