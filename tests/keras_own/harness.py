"""Keras' test files loaded from the source distribution, their TestCase classes per run, and the fit that replaces
keras.Model.fit with a record of what each call trained."""

import contextlib
import dataclasses
import glob
import importlib.metadata
import importlib.util
import os
import sys
import types
import unittest
from typing import List, Optional

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERAS_VERSION = importlib.metadata.version("keras")
SOURCE = os.path.join(ROOT, ".keras-tests", f"keras-{KERAS_VERSION}", "keras", "src")
PATTERNS = ("trainers/trainer_test.py", "callbacks/*_test.py")
BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keras_passes.txt")
# Set (to the path to write) by `make keras-own-baseline`: every test runs on Keras, and the list is written.
BASELINE_RUN = os.environ.get("KERAS_OWN_BASELINE", "")

# gpupar.fit's options of each run, besides model.fit's arguments: they pick the devices, nothing else.
FIT_OPTIONS = {1: {"strategy": "one_device"}, 2: {"strategy": "mirrored", "virtual_cpus": 2}}


def keras_test_files() -> List[str]:
    """The Keras test files of the extracted source distribution, relative to keras/src, sorted.

    Raises:
      pytest.UsageError: the files are not there (`make keras-tests` extracts them).
    """
    files = sorted(os.path.relpath(path, SOURCE) for pattern in PATTERNS
                   for path in glob.glob(os.path.join(SOURCE, pattern)))
    if not any(f.startswith("trainers/") for f in files) or not any(f.startswith("callbacks/") for f in files):
        raise pytest.UsageError(f"Keras {KERAS_VERSION}'s own tests are not in {SOURCE}: run `make keras-tests` (it "
                                "downloads the source distribution of the installed Keras)")
    return files


def _skip_if_backend(given_backend, reason):
    """Keras' root conftest.py's skip_if_backend (that file is not in the source distribution)."""
    from keras.src.backend import backend

    return pytest.mark.skipif(backend() == given_backend, reason=reason)


class _Absent(types.ModuleType):
    """A module that is not installed: importing it works, using it raises ImportError."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"{self.__name__} is not installed (a stand-in of tests/keras_own lets the test file import)")


@contextlib.contextmanager
def _importable_test_file():
    """While a test file runs its imports: a stand-in for jax where it is absent (trainer_test.py imports it at the top
    for its jax-backend tests), and a `conftest` module with Keras' skip_if_backend."""
    stand_ins = {"conftest": types.ModuleType("conftest")}
    stand_ins["conftest"].skip_if_backend = _skip_if_backend
    if importlib.util.find_spec("jax") is None:
        stand_ins["jax"] = _Absent("jax")
    before = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name, module in before.items():
            if module is None:
                del sys.modules[name]
            else:
                sys.modules[name] = module


def load(relative_path: str) -> types.ModuleType:
    """The Keras test file at keras/src/<relative_path> of the source distribution, imported as its own module.

    Not as keras.src.<...>: the installed wheel may hold a file of that name, and the source
    distribution's is the one under test.
    """
    name = "keras_own_source." + relative_path[:-len(".py")].replace("/", ".")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(SOURCE, relative_path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with _importable_test_file():
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def run_classes(variant) -> dict:
    """{"<file stem>.<class>": a subclass that runs as `variant`} for the TestCase classes of the Keras test files,
    with only keras_passes.txt's tests (all of them in the run that writes it).

    variant: "keras" (Keras' own fit), 1 or 2 (gpupar.fit on that many replicas). In the run that
    writes keras_passes.txt, a file that cannot be imported gives a class whose one test fails
    with the import error.

    Raises:
      pytest.UsageError: keras_passes.txt or differences.py names a test that is not here.
    """
    classes, import_errors = {}, {}
    for relative_path in keras_test_files():
        stem = os.path.basename(relative_path)[:-len(".py")]
        try:
            module = load(relative_path)
        except Exception as e:  # noqa: BLE001  (any import error is reported as the file's failure)
            import_errors[relative_path] = f"{type(e).__name__}: {e}"
            classes[f"{stem}.ImportError"] = _import_failure(relative_path, import_errors[relative_path], variant)
            continue
        for class_name, cls in vars(module).items():
            # As pytest collects them in Keras' own run: TestCase classes defined in the file.
            if isinstance(cls, type) and issubclass(cls, unittest.TestCase) and cls.__module__ == module.__name__:
                name = f"{stem}.{class_name}"
                classes[name] = type(name, (cls,), {"keras_own_variant": variant, "keras_own_file": relative_path,
                                                    "__qualname__": name})
    if BASELINE_RUN:
        return classes
    baseline = read_baseline()
    _check_listed(classes, baseline, import_errors)
    return _only_listed(classes, baseline)


def _test_names(cls) -> List[str]:
    return unittest.TestLoader().getTestCaseNames(cls)


def _check_listed(classes, baseline, import_errors):
    """Every test that keras_passes.txt and differences.py name is one of these classes' tests."""
    from keras_own.differences import DIFFERENCES

    here = {f"{name}::{method}" for name, cls in classes.items() for method in _test_names(cls)}
    missing = sorted(set(baseline) - here)
    if missing:
        raise pytest.UsageError(f"keras_passes.txt lists {len(missing)} test(s) that Keras {KERAS_VERSION}'s test files "
                                f"do not have here, e.g. {missing[0]}"
                                + "".join(f"; keras/src/{path} does not import: {error}"
                                          for path, error in import_errors.items())
                                + ": fix the import, or run `make keras-own-baseline`")
    for key, reason in DIFFERENCES.items():
        test_id, replicas = key if isinstance(key, tuple) else (key, None)
        if test_id not in baseline or replicas not in (None, 1, 2) or not reason:
            raise pytest.UsageError(f"differences.py: {key!r} is not a test of keras_passes.txt at 1 or 2 replicas "
                                    "with a reason")


def _only_listed(classes, baseline) -> dict:
    """The classes that hold tests of keras_passes.txt, each with only those: the others are not collected at all."""
    kept = {}
    for name, cls in classes.items():
        names = _test_names(cls)
        listed = [method for method in names if f"{name}::{method}" in baseline]
        if listed:
            for method in set(names) - set(listed):
                setattr(cls, method, None)  # unittest (and pytest's unittest collection) takes no test that is None
            kept[name] = cls
    return kept


def difference(test_id: str, replicas: int) -> Optional[str]:
    """differences.py's reason why gpupar.fit on `replicas` replicas need not pass the test, or None."""
    from keras_own.differences import DIFFERENCES

    return DIFFERENCES.get((test_id, replicas), DIFFERENCES.get(test_id))


def _import_failure(relative_path, error: str, variant):
    message = f"keras/src/{relative_path} does not import here: {error}"

    def test_import(self):
        raise ImportError(message)

    return type("ImportError", (unittest.TestCase,), {"test_import": test_import, "keras_own_variant": variant,
                                                       "keras_own_file": relative_path})


def keep_devices(monkeypatch):
    """Keeps the process's TensorFlow context and devices as the session made them, for the rest of the test.

    swap_ema_weights_test's tf.distribute test resets TensorFlow's context and makes 2 virtual
    CPUs of it (for a process of its own in Keras' CI), which would leave 2 of the session's 4 to
    every later test of this pytest worker. Here the reset does nothing, and the one device
    configuration that follows it, asking for no more CPUs than the session has, is taken as done.
    """
    import tensorflow as tf
    from tensorflow.python.eager import context

    configure = tf.config.set_logical_device_configuration
    reset = []

    def reset_context():
        reset.append(True)

    def set_logical_device_configuration(device, logical_devices):
        if reset and device.device_type == "CPU" and len(logical_devices) <= len(tf.config.list_logical_devices("CPU")):
            reset.clear()
            return
        configure(device, logical_devices)

    monkeypatch.setattr(context, "_reset_context", reset_context)
    monkeypatch.setattr(tf.config, "set_logical_device_configuration", set_logical_device_configuration)


def keras_id(nodeid: str) -> str:
    """The test's id without its run: "trainer_test.TestTrainer::test_fit_flow_graph_fn"."""
    return nodeid.split("::", 1)[1]


# --- What each fit trained -------------------------------------------------------------------------------------------


def _value(variable):
    from keras import ops

    return np.array(ops.convert_to_numpy(variable))


def _iterations(optimizer) -> Optional[int]:
    try:
        return int(_value(optimizer.iterations))
    except Exception:  # noqa: BLE001  (an optimizer without iterations, or not built)
        return None


@dataclasses.dataclass
class FitCall:
    """One call of keras.Model.fit in a test: the model's state before it, and whether the call trained the model.

    `updated` is None while the call runs, or when it raised; True where the optimizer's iterations
    advanced or a trainable weight that existed before the call changed; False otherwise.
    """

    model: object
    weights: list
    optimizer: object
    iterations: Optional[int]
    updated: Optional[bool] = None
    detail: str = "raised"

    @classmethod
    def before(cls, model) -> "FitCall":
        optimizer = getattr(model, "optimizer", None)
        weights = [(v, _value(v)) for v in model.trainable_variables]
        return cls(model, weights, optimizer, _iterations(optimizer) if optimizer is not None else None)

    def after(self):
        changed = sum(not np.array_equal(before, _value(v)) for v, before in self.weights)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is self.optimizer:
            before, after = self.iterations, _iterations(optimizer) if optimizer is not None else None
        else:  # fit put another optimizer on the model: it started from 0
            before, after = 0, _iterations(optimizer) if optimizer is not None else None
        advanced = before is not None and after is not None and after > before
        self.updated = bool(changed or advanced)
        self.detail = (f"optimizer.iterations {before} -> {after}, {changed} of the {len(self.weights)} trainable "
                       "weights that existed before the call changed")
        self.forget()

    def forget(self):
        """Lets go of the model, its optimizer and weights (a call that raised still holds them)."""
        self.model = self.optimizer = self.weights = None

    @property
    def code(self) -> str:
        """1: trained, 0: returned without training, x: raised."""
        return {True: "1", False: "0", None: "x"}[self.updated]


def recording_fit(fit, calls: list, options: dict = None):
    """A keras.Model.fit that calls `fit(model, *args, **kwargs, **options)` and appends a FitCall to `calls`."""

    def replaced_fit(self, *args, **kwargs):
        call = FitCall.before(self)
        calls.append(call)
        result = fit(self, *args, **kwargs, **(options or {}))
        call.after()
        return result

    return replaced_fit


# --- keras_passes.txt: the tests that count ---------------------------------------------------------------------------

_BASELINE_HEADER = """\
# Keras' own tests that pass on Keras here and fit a keras.Model, each with what its fits did in order
# (1: trained, 0: returned without training, x: raised). Written by `make keras-own-baseline`, which runs
# tests/keras_own/test_on_keras.py with KERAS_OWN_BASELINE set; do not edit by hand.
"""


def read_baseline(path: str = BASELINE) -> dict:
    """{Keras test id: its fits' codes} of keras_passes.txt.

    Raises:
      pytest.UsageError: the file is missing or was written for another Keras version.
    """
    if not os.path.exists(path):
        raise pytest.UsageError(f"{path} is missing: run `make keras-own-baseline`")
    entries, version = {}, None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("keras="):
                version = line.split()[0][len("keras="):]
                continue
            test_id, codes = line.split()
            entries[test_id] = codes
    if version != KERAS_VERSION:
        raise pytest.UsageError(f"{path} was written on Keras {version}, and Keras {KERAS_VERSION} is installed: run "
                                "`make keras-own-baseline`")
    return entries


def write_baseline(entries: dict, path: str):
    """Writes keras_passes.txt: {Keras test id: its fits' codes}, sorted."""
    import tensorflow as tf

    with open(path + ".tmp", "w") as f:
        f.write(_BASELINE_HEADER)
        f.write(f"keras={KERAS_VERSION} tensorflow={tf.__version__}\n")
        for test_id in sorted(entries):
            f.write(f"{test_id} {entries[test_id]}\n")
    os.replace(path + ".tmp", path)
