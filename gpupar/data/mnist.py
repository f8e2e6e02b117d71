"""The MNIST-format data sets in memory: from an IDX folder, or downloaded and prepared by TFDS."""

import numpy as np

from gpupar.data import idx
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
