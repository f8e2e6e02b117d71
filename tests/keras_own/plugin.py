"""pytest hooks of the Keras peer suite (tests/keras_own): which tests run, fit replaced per test, the update check,
keras_passes.txt written, and the counts.

Loaded by tests/conftest.py (pytest_plugins), so that the process that reports (pytest-xdist's
controller, which collects nothing) counts the outcomes too. Every hook leaves other tests alone.
"""

import json
import os
from typing import Optional

import pytest

from keras_own import harness

# One test module per run: Keras' own fit, then gpupar.fit on 1 and on 2 replicas.
RUNS = {"test_on_keras.py": "keras", "test_one_replica.py": 1, "test_two_replicas.py": 2}
RUN_NAMES = {"keras": "Keras' model.fit", 1: "gpupar.fit, 1 replica", 2: "gpupar.fit, 2 replicas"}
SEED = 1337  # keras.utils.set_random_seed before each Keras test (the fixture says why)
RESULTS_ENV = "KERAS_OWN_RESULTS"  # a path: every outcome, with its message, written there as JSON
_CALLS = pytest.StashKey[list]()


class NoUpdate(AssertionError):
    """A test passed through gpupar.fit, but a fit of it trained nothing where Keras' fit trained."""


def _run_of(item) -> Optional[object]:
    return getattr(getattr(item, "cls", None), "keras_own_variant", None)


def pytest_configure(config):
    # Keras' own markers (its root conftest.py registers them).
    config.addinivalue_line("markers", "requires_trainable_backend: Keras' mark for tests of a trainable backend")
    config.addinivalue_line("markers", "multi_device: Keras' mark for tests that need several devices")


def pytest_collection_modifyitems(config, items):
    """Skips Keras' multi_device tests (as Keras' conftest does on TensorFlow); marks differences.py's tests strict
    xfails on gpupar's runs. (harness.run_classes has left out the tests that are not in keras_passes.txt.)"""
    for item in items:
        run = _run_of(item)
        if run is None:
            continue
        if item.get_closest_marker("multi_device"):
            item.add_marker(pytest.mark.skip(reason="Requires multiple devices (Keras' conftest.py, on TensorFlow)"))
        reason = harness.difference(harness.keras_id(item.nodeid), run) if run in (1, 2) else None
        if reason:
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"differences.py: {reason}"))


@pytest.fixture(autouse=True)
def _keras_own_fit(request, monkeypatch):
    """In a Keras test: the random seed set, and keras.Model.fit its run's fit (Keras' own or gpupar.fit), recording
    each call."""
    run = _run_of(request.node)
    if run is None:
        yield
        return
    import keras

    # Keras' own run seeds nothing; here every run of a test starts from the same weights and data, so that an outcome
    # that depends on them (a loss that diverges from some initial weights) is the same in every run and every time.
    keras.utils.set_random_seed(SEED)
    calls = request.node.stash[_CALLS] = []
    if run == "keras":
        fit, options = keras.Model.fit, None
    else:
        import gpupar

        fit, options = gpupar.fit, harness.FIT_OPTIONS[run]
    monkeypatch.setattr(keras.Model, "fit", harness.recording_fit(fit, calls, options))
    harness.keep_devices(monkeypatch)
    yield


_baseline = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """After a Keras test that passed: each fit that trained on Keras (keras_passes.txt) trained this time too."""
    result = yield
    calls = item.stash.get(_CALLS, None)
    if calls is None:
        return result
    codes = "".join(call.code for call in calls)
    for call in calls:
        call.forget()
    item.user_properties.append(("keras_own_fits", codes))
    # A unittest test's failure or skip is kept on the item until its report (pytest's unittest.py).
    if getattr(item, "_excinfo", None) or harness.BASELINE_RUN:
        return result
    global _baseline
    _baseline = _baseline or harness.read_baseline()
    expected = _baseline[harness.keras_id(item.nodeid)]
    run = _run_of(item)
    if run == "keras":
        if codes != expected:
            raise AssertionError(f"keras_passes.txt says this test's fits did {expected}, and Keras' fits did {codes} "
                                 "now (1: trained, 0: returned without training, x: raised): run `make keras-own-baseline`")
        return result
    for i, code in enumerate(expected):
        if code == "1" and (i >= len(calls) or not calls[i].updated):
            item.user_properties.append(("keras_own_no_update", "1"))
            detail = calls[i].detail if i < len(calls) else "there was no such call"
            raise NoUpdate(f"the test passed, but fit call {i + 1} of {len(expected)} trained nothing through gpupar.fit "
                           f"where Keras' fit trained ({detail})")
    return result


# --- In the reporting process: the counts, keras_passes.txt, the results file ------------------------------------------

_outcomes = {}  # (run, Keras test id) -> (outcome, message)
_fits = {}  # Keras test id -> its fits' codes, from the reports of test_on_keras.py


def _message(report) -> str:
    """The error of a failed report (its first 1000 characters), or a skip's reason."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        text = crash.message
    elif isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        text = report.longrepr[-1]
    else:
        text = str(report.longrepr or "")
    return text.strip()[:1000]


def pytest_runtest_logreport(report):
    path, _, rest = report.nodeid.partition("::")
    run = RUNS.get(os.path.basename(path)) if os.path.basename(os.path.dirname(path)) == "keras_own" else None
    if run is None or not rest:
        return
    key, properties = (run, rest), dict(report.user_properties)
    if report.when == "call" and run == "keras" and report.passed and properties.get("keras_own_fits"):
        _fits[rest] = properties["keras_own_fits"]
    if report.when == "teardown" and report.failed:
        _fits.pop(rest, None)
    if report.failed:
        outcome = "no update" if properties.get("keras_own_no_update") else (
            "failed" if report.when == "call" else "error")
        _outcomes[key] = (outcome, _message(report))
    elif report.skipped and key not in _outcomes:
        _outcomes[key] = ("xfailed" if hasattr(report, "wasxfail") else "skipped",
                          getattr(report, "wasxfail", "") or _message(report))
    elif report.when == "call" and report.passed:
        _outcomes[key] = ("passed", "")


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput") or not _outcomes:
        return  # a pytest-xdist worker: the controller reports
    if harness.BASELINE_RUN:
        _write_baseline(session.config, exitstatus)
    results_path = os.environ.get(RESULTS_ENV)
    if results_path:
        results = {RUN_NAMES[run]: {} for run in RUNS.values()}
        for (run, test_id), (outcome, message) in sorted(_outcomes.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            results[RUN_NAMES[run]][test_id] = {"outcome": outcome, "message": message}
        with open(results_path, "w") as f:
            json.dump({"keras": harness.KERAS_VERSION, "results": results}, f, indent=1)
            f.write("\n")


def _write_baseline(config, exitstatus):
    ran_all = not (config.option.keyword or config.option.markexpr or config.option.deselect or config.option.lf)
    if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or not ran_all:
        raise pytest.UsageError("keras_passes.txt is written by a whole run of test_on_keras.py (no -k, -m, --deselect, "
                                "--lf, not interrupted): not written")
    harness.write_baseline(_fits, harness.BASELINE_RUN)


def pytest_terminal_summary(terminalreporter):
    """How many of keras_passes.txt's tests each run passed."""
    if not _outcomes or harness.BASELINE_RUN:
        if _outcomes:
            terminalreporter.write_line(f"keras_passes.txt: {len(_fits)} tests pass on Keras and fit a keras.Model")
        return
    counted = harness.read_baseline()
    terminalreporter.write_sep("-", f"Keras {harness.KERAS_VERSION}'s own trainer and callback tests: {len(counted)} "
                                    "pass on Keras and fit a keras.Model")
    for run in RUNS.values():
        outcomes = [outcome for (r, test_id), (outcome, _) in _outcomes.items() if r == run and test_id in counted]
        if not outcomes:
            continue
        counts = ", ".join(f"{outcomes.count(o)} {o}" for o in
                           ("passed", "failed", "no update", "error", "xfailed", "skipped") if outcomes.count(o))
        ran = "" if len(outcomes) == len(counted) else f" (of {len(outcomes)} run)"
        terminalreporter.write_line(f"{RUN_NAMES[run]:>24}: {outcomes.count('passed')} of {len(counted)} pass{ran}; "
                                    f"{counts}")
