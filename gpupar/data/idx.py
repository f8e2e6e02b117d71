"""Reading and validating MNIST-format IDX files (the classic MNIST_data folder)."""

import dataclasses
import gzip
import os
import zlib

import numpy as np

from gpupar.errors import GpuparError

IMAGE_MAGIC = 2051
LABEL_MAGIC = 2049
IMAGE_SIZE = 28
NUM_CLASSES = 10
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


@dataclasses.dataclass(frozen=True)
class Splits:
    """A dataset in memory: uint8 images (N, 28, 28) and int32 labels (N,) for train and test."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def find_file(data_dir: str, stem: str) -> str:
    """The path of `stem` or `stem.gz` in data_dir; a GpuparError if neither is there."""
    for name in (stem, stem + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    raise GpuparError(f"{os.path.join(data_dir, stem)}[.gz]: file not found in data_dir {data_dir!r}")


def _read_bytes(path: str) -> bytes:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise GpuparError(f"{path}: cannot read it ({e}); the file is damaged, download it again") from None


def read_idx(path: str, expected_magic: int) -> np.ndarray:
    """Reads one IDX file of unsigned bytes, checking its header against its size."""
    data = _read_bytes(path)
    if len(data) < 4:
        raise GpuparError(f"{path}: only {len(data)} bytes, too short for an IDX header")
    magic = int.from_bytes(data[:4], "big")
    if magic != expected_magic:
        kind = "images" if expected_magic == IMAGE_MAGIC else "labels"
        raise GpuparError(
            f"{path}: magic number {magic} is not {expected_magic} (IDX {kind}); "
            "is this the right file, or a file swapped with another?"
        )
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise GpuparError(f"{path}: truncated header ({len(data)} bytes, need {header})")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    expected = header + int(np.prod(dims, dtype=np.int64))
    if len(data) != expected:
        raise GpuparError(
            f"{path}: header says dimensions {dims} ({expected} bytes) but the file has "
            f"{len(data)} bytes; it is truncated or damaged"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def read_images(path: str) -> np.ndarray:
    """Reads an IDX image file; refuses any size other than 28x28 instead of reshaping it."""
    images = read_idx(path, IMAGE_MAGIC)
    if images.ndim != 3 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
        raise GpuparError(
            f"{path}: images have shape {list(images.shape[1:])}, the ConvNet needs "
            f"{IMAGE_SIZE}x{IMAGE_SIZE}"
        )
    return images


def read_labels(path: str) -> np.ndarray:
    """Reads an IDX label file and checks every label is a digit class 0..9."""
    labels = read_idx(path, LABEL_MAGIC)
    if labels.ndim != 1:
        raise GpuparError(f"{path}: labels have {labels.ndim} dimensions, expected 1")
    if labels.size and labels.max() >= NUM_CLASSES:
        bad = int(np.argmax(labels >= NUM_CLASSES))
        raise GpuparError(
            f"{path}: label {int(labels[bad])} at index {bad} is outside 0..{NUM_CLASSES - 1}"
        )
    return labels.astype(np.int32)


def _split(data_dir: str, images_stem: str, labels_stem: str):
    images_path = find_file(data_dir, images_stem)
    labels_path = find_file(data_dir, labels_stem)
    images, labels = read_images(images_path), read_labels(labels_path)
    if len(images) != len(labels):
        raise GpuparError(
            f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} "
            "labels; the two files do not belong together"
        )
    if len(images) == 0:
        raise GpuparError(f"{images_path}: holds no images")
    return images, labels


def load_idx_dir(data_dir: str) -> Splits:
    """Loads the four IDX files of an MNIST-format folder."""
    train = _split(data_dir, FILES["train_images"], FILES["train_labels"])
    test = _split(data_dir, FILES["test_images"], FILES["test_labels"])
    return Splits(*train, *test)

