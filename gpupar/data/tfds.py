"""TFDS data sets: loaded (downloaded and prepared the first time), and the errors of a failed load.

    import tensorflow_datasets as tfds   # what gpupar calls; names as TFDS has them: "mnist", "cifar10"
"""

from gpupar.errors import GpuparError


def load(name: str, split, download: bool = True):
    """tfds.load(name, split=split, as_supervised=True): (input, label) examples, unbatched.

    A data set not yet prepared here is downloaded and prepared, after a quick check that its
    server can be reached (TFDS itself retries for minutes).

    Raises:
      GpuparError: the load failed: a missing package (named), no connection, or what TFDS said.
    """
    import tensorflow_datasets as tfds

    try:
        try:
            return tfds.load(name, split=split, as_supervised=True, download=False)
        except AssertionError:  # TFDS's "could not find data": not prepared on this machine yet
            if not download:
                raise
            _reach(getattr(tfds.builder(name), "URL", None))
            return tfds.load(name, split=split, as_supervised=True, download=True)
    except Exception as e:  # TFDS raises many types for a failed download or a missing builder.
        raise tfds_error(name, e) from None


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
