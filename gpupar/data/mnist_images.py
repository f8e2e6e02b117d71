"""The MNIST-format data sets in memory (an IDX folder, or TFDS), and their preparation for the ConvNet."""

import numpy as np
import tensorflow as tf

from gpupar.data import augment, idx, tfds


def load_tfds(name: str, download: bool = True) -> idx.Splits:
    """Loads a TFDS MNIST-format data set fully into memory (downloading and preparing it the first time)."""
    train, test = tfds.load(name, ["train", "test"], download)
    train_images, train_labels = _to_numpy(train)
    test_images, test_labels = _to_numpy(test)
    return idx.Splits(train_images, train_labels, test_images, test_labels)


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


def normalise(images, labels):
    """uint8 images (B, 28, 28) -> float32 (B, 28, 28, 1) in [0, 1]; the labels as they are."""
    return tf.cast(images, tf.float32)[..., tf.newaxis] / 255.0, labels


def host_augmentation(seed: int):
    """The per-example host transform (gpupar.data.array_pipeline.train_dataset) that normalises and warps an image."""

    def transform(example, pass_number, position):
        image, label = normalise(*example)
        return augment.host_affine(image, augment.host_seed(seed, pass_number, position)), label

    return transform
