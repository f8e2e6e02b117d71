"""Test session set-up: four virtual CPU devices, made before TensorFlow initialises."""

import gzip
import os
import sys
import time

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402  (the environment variable must come first)

NUM_VIRTUAL_CPUS = 4
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(NUM_VIRTUAL_CPUS)]
)
assert len(tf.config.list_logical_devices("CPU")) == NUM_VIRTUAL_CPUS  # initialises the runtime now

# Keras' own tests through gpupar.fit (tests/keras_own): its hooks, here so that the reporting process loads them too.
pytest_plugins = ["keras_own.plugin"]

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: where benchmarks/ is


def write_idx(path, array):
    """Writes a uint8 array as an IDX file, gzipped when the path ends in .gz."""
    array = np.asarray(array, dtype=np.uint8)
    magic = 2051 if array.ndim == 3 else 2049
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def synthetic_digits(num, seed):
    """Images whose class is a bright 7x7 block at one of ten positions, plus noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=num)
    images = rng.integers(0, 60, size=(num, 28, 28))
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 5)
        images[i, 3 + row * 12: 10 + row * 12, 1 + col * 5: 8 + col * 5] = 255
    return images.astype(np.uint8), labels.astype(np.uint8)


def make_idx_dir(folder, num_train=256, num_test=100, gz=True):
    """Writes a small learnable MNIST-format dataset into folder and returns its path."""
    os.makedirs(folder, exist_ok=True)
    suffix = ".gz" if gz else ""
    train_x, train_y = synthetic_digits(num_train, 1)
    test_x, test_y = synthetic_digits(num_test, 2)
    write_idx(os.path.join(folder, "train-images-idx3-ubyte" + suffix), train_x)
    write_idx(os.path.join(folder, "train-labels-idx1-ubyte" + suffix), train_y)
    write_idx(os.path.join(folder, "t10k-images-idx3-ubyte" + suffix), test_x)
    write_idx(os.path.join(folder, "t10k-labels-idx1-ubyte" + suffix), test_y)
    return str(folder)


@pytest.fixture(scope="session", autouse=True)
def _subprocesses_without_keras_extras():
    """Python subprocesses of the tests load tests/child_site/sitecustomize.py (why: its docstring).

    Set here, in the process that runs the tests, not at import: pytest-xdist's workers, started
    with the environment of the process that imported this file first, run the tests that give
    Keras pandas DataFrames.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.path.join(ROOT, "tests", "child_site"), prepend=os.pathsep)
        yield


@pytest.fixture(autouse=True)
def _runs_in_tmp_path(tmp_path, monkeypatch):
    """Every test runs in its own folder, so the runs/ folders that runs create by default land there."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _no_process_strategy_defaults():
    """A test's gpupar.strategy(...) call sets the defaults of later fits in its process: none outlive the test."""
    yield
    process = sys.modules.get("gpupar.training.process")
    if process is not None:
        process._DEFAULTS.clear()


@pytest.fixture
def idx_dir(tmp_path):
    """A small synthetic MNIST-format folder (256 train, 100 test images, gzipped)."""
    return make_idx_dir(tmp_path / "data")


@pytest.fixture(scope="session")
def shared_idx_dir(tmp_path_factory):
    """The same synthetic folder, made once for tests that only read it."""
    return make_idx_dir(tmp_path_factory.mktemp("data"))


_exit_status = 0


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leaves without interpreter teardown, once pytest has reported everything.

    Teardown destroys the tf.data iterators that the runs kept alive, and TensorFlow 2.21 blocks
    on each of them until its autotune thread wakes (see gpupar.teardown): minutes for a whole
    suite. Nothing is left to flush by then.
    """
    from gpupar.runtime.teardown import exit_without_teardown

    exit_without_teardown(_exit_status)


@pytest.fixture
def slow_host_warp(monkeypatch):
    """Host augmentation made slow: 4 ms per image, a second per 256-image batch (half that on two
    threads), far more than a step takes even when another test shares the cores."""
    from gpupar.data import augment

    def warp(image, transform):
        time.sleep(0.004)
        return image

    monkeypatch.setattr(augment, "warp_numpy", warp)


def two_replicas():
    """Keras' own MirroredStrategy(["/cpu:0", "/cpu:1"]), with collective keys of its own.

    Every MirroredStrategy made in one process numbers its all-reduces (collective group and
    instance keys) from the same start, and the runtime remembers each instance's shape: a second
    strategy's first all-reduce of another shape fails ("Shape mismatch in the collective instance
    100"). TensorFlow's own tests give each strategy a new key base for that
    (strategy_combinations._mirrored_strategy_with_collective_key_base); so does this.
    """
    tf.distribute.MirroredStrategy._collective_key_base += 100000
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def fit_data(data):
    """model.fit's x, y and sample_weight of test data given as (x, y) or (x, y, sample_weight); any other form is x."""
    if isinstance(data, tuple) and 2 <= len(data) <= 3:
        return dict(zip(("x", "y", "sample_weight"), data))
    return dict(x=data)


@pytest.fixture
def float32_only(monkeypatch):
    """Devices without a faster number format for gpupar diagnose: it builds the model once, not three
    times (tests/test_precision.py tests its float32 against bfloat16 runs)."""
    from gpupar.commands import diagnose
    from gpupar.runtime.precision import plan_precision

    monkeypatch.setattr(diagnose, "machine_precision", lambda gpus: plan_precision(("avx2",)))
