"""Data sources (TFDS or an IDX folder) and the tf.data input pipeline."""

import math

import numpy as np
import tensorflow as tf

from gpupar import augment, idx
from gpupar.errors import GpuparError


def load_tfds(name: str, download: bool = True) -> idx.Splits:
    """Loads a TFDS dataset fully into memory (downloading and preparing it the first time)."""
    import tensorflow_datasets as tfds

    splits = dict(split=["train", "test"], as_supervised=True)
    try:
        try:
            train, test = tfds.load(name, download=False, **splits)
        except AssertionError:  # TFDS's "could not find data": not prepared on this machine yet
            if not download:
                raise
            _reach(getattr(tfds.builder(name), "URL", None))
            train, test = tfds.load(name, download=True, **splits)
    except Exception as e:  # TFDS raises many types for a failed download or a missing builder.
        raise tfds_error(name, e) from None
    train_images, train_labels = _to_numpy(train)
    test_images, test_labels = _to_numpy(test)
    return idx.Splits(train_images, train_labels, test_images, test_labels)


def _reach(url, timeout: float = 10.0):
    """Raises at once when the download server cannot be reached (TFDS itself retries for minutes)."""
    if url and url.startswith("http"):
        import requests

        requests.head(url, timeout=timeout)


# Exceptions of a download that could not reach its server (requests', urllib's, socket's).
_NETWORK_ERRORS = ("ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "URLError", "gaierror",
                   "ProxyError", "SSLError", "MaxRetryError", "NewConnectionError")


def tfds_error(name: str, error: BaseException) -> GpuparError:
    """The user-facing error for a failed tfds.load: a missing package, no network, or what TFDS said."""
    chain, seen = [], error
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    missing = next((e for e in chain if isinstance(e, ImportError)), None)
    if missing is not None:
        package = getattr(missing, "name", None) or str(missing)
        return GpuparError(
            f"could not load TFDS dataset {name!r}: TFDS needs the Python package {package!r}, which is not "
            f"installed; pip install {package} (or reinstall gpupar, which depends on it)")
    first_line = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if any(type(e).__name__ in _NETWORK_ERRORS for e in chain):
        return GpuparError(
            f"could not download TFDS dataset {name!r}: no connection to its server ({first_line[:200]}); "
            "without internet, pass --data_dir pointing at a folder with the four MNIST-format IDX files "
            "(e.g. /usr/share/datasets/fashion-mnist from Debian's dataset-fashion-mnist)")
    if isinstance(error, AssertionError) and "could not find data" in str(error):
        return GpuparError(
            f"could not load TFDS dataset {name!r}: it is not prepared on this machine ({first_line[:200]}); let "
            "TFDS download it (with internet), or pass --data_dir pointing at a folder with the four "
            "MNIST-format IDX files")
    return GpuparError(f"could not load TFDS dataset {name!r} ({first_line[:300]})")


def _to_numpy(ds):
    """(image (28, 28, 1) uint8, label) examples -> uint8 (N, 28, 28) and int32 (N,) arrays."""
    images, labels = [], []
    for x, y in ds.batch(10_000).as_numpy_iterator():
        images.append(x[..., 0])
        labels.append(y.astype(np.int32))
    return np.concatenate(images), np.concatenate(labels)


def load_splits(dataset: str, data_dir=None) -> idx.Splits:
    """The dataset from an IDX folder when data_dir is given, else from TFDS."""
    return idx.load_idx_dir(data_dir) if data_dir else load_tfds(dataset)


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
