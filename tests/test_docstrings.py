"""The examples in the package's docstrings run as they are written (doctest), so none can go stale."""

import doctest
import importlib

import pytest

from test_layout import _modules

MODULES = sorted(name for name in _modules() if not name.endswith("__main__"))  # that one runs the command


def _examples(name):
    return [test for test in doctest.DocTestFinder().find(importlib.import_module(name)) if test.examples]


@pytest.mark.parametrize("name", [m for m in MODULES if _examples(m)])
def test_a_docstring_example_runs_as_written(name):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in _examples(name):
        runner.run(test)
    assert runner.failures == 0, f"{name}: {runner.failures} failing docstring example(s)"


def test_the_public_api_and_the_modes_show_examples():
    """Control: the finder sees the examples (a parametrization that found none would test nothing)."""
    assert _examples("gpupar") and _examples("gpupar.training.modes")


def test_a_wrong_example_fails():
    """Control: a docstring whose example prints something else fails."""
    test = doctest.DocTestParser().get_doctest(">>> 1 + 1\n3\n", {}, "wrong", None, 0)
    runner = doctest.DocTestRunner()
    runner.run(test, out=lambda _: None)
    assert runner.failures == 1
