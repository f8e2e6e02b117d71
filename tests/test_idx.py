"""IDX files: reading, and one clear error naming the file for every kind of bad file."""

import gzip
import os

import numpy as np
import pytest

from conftest import make_idx_dir, write_idx
from gpupar.data import idx
from gpupar.errors import GpuparError


def test_reads_gzipped_and_plain_folders(tmp_path):
    for gz in (True, False):
        splits = idx.load_idx_dir(make_idx_dir(tmp_path / str(gz), gz=gz))
        assert splits.train_images.shape == (256, 28, 28) and splits.train_images.dtype == np.uint8
        assert splits.test_labels.shape == (100,) and splits.test_labels.dtype == np.int32
        assert set(np.unique(splits.train_labels)) <= set(range(10))


def test_reads_the_real_fashion_mnist_files():
    from conftest import FASHION_MNIST

    splits = idx.load_idx_dir(FASHION_MNIST)
    assert splits.train_images.shape == (60000, 28, 28) and splits.test_images.shape == (10000, 28, 28)
    assert np.bincount(splits.test_labels).tolist() == [1000] * 10


def _corrupt(folder, name, data: bytes):
    path = os.path.join(folder, name)
    with gzip.open(path, "wb") as f:
        f.write(data)
    return path


def _refused(folder, match):
    """Expects load_idx_dir(folder) to fail with `match`, checks it changed no file; returns the error."""
    before = {name: open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)}
    with pytest.raises(GpuparError, match=match) as e:
        idx.load_idx_dir(folder)
    assert {name: open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)} == before
    return e


def _bytes(path):
    with gzip.open(path, "rb") as f:
        return f.read()


def test_missing_file(idx_dir):
    os.remove(os.path.join(idx_dir, "t10k-labels-idx1-ubyte.gz"))
    _refused(idx_dir, r"t10k-labels-idx1-ubyte\[\.gz\]: file not found")


def test_bad_magic_number(idx_dir):
    labels = os.path.join(idx_dir, "train-labels-idx1-ubyte.gz")
    images = os.path.join(idx_dir, "train-images-idx3-ubyte.gz")
    swapped = _bytes(images)
    _corrupt(idx_dir, "train-labels-idx1-ubyte.gz", swapped)
    e = _refused(idx_dir, "magic number")
    assert str(e.value).startswith(labels) and "magic number 2051 is not 2049" in str(e.value)


def test_truncated_file(idx_dir):
    path = os.path.join(idx_dir, "train-images-idx3-ubyte.gz")
    _corrupt(idx_dir, "train-images-idx3-ubyte.gz", _bytes(path)[:-100])
    e = _refused(idx_dir, "truncated or damaged")
    assert path in str(e.value)


def test_too_short_for_a_header(idx_dir):
    _corrupt(idx_dir, "t10k-images-idx3-ubyte.gz", b"\x00\x00")
    _refused(idx_dir, "too short for an IDX header")


def test_corrupt_gzip(idx_dir):
    path = os.path.join(idx_dir, "t10k-images-idx3-ubyte.gz")
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"\xff" * 50)
    e = _refused(idx_dir, "cannot read it")
    assert path in str(e.value)


def test_image_and_label_counts_disagree(idx_dir):
    write_idx(os.path.join(idx_dir, "t10k-labels-idx1-ubyte.gz"), np.zeros(99))
    _refused(idx_dir, "holds 100 images but .* holds 99 labels")


def test_label_out_of_range(idx_dir):
    labels = np.zeros(100)
    labels[7] = 12
    write_idx(os.path.join(idx_dir, "t10k-labels-idx1-ubyte.gz"), labels)
    _refused(idx_dir, "label 12 at index 7 is outside 0..9")


def test_wrong_image_size_is_refused_not_reshaped(idx_dir):
    write_idx(os.path.join(idx_dir, "t10k-images-idx3-ubyte.gz"), np.zeros((100, 32, 32)))
    _refused(idx_dir, r"images have shape \[32, 32\], the ConvNet needs 28x28")


def test_empty_split(idx_dir):
    write_idx(os.path.join(idx_dir, "t10k-images-idx3-ubyte.gz"), np.zeros((0, 28, 28)))
    write_idx(os.path.join(idx_dir, "t10k-labels-idx1-ubyte.gz"), np.zeros(0))
    _refused(idx_dir, "holds no images")
