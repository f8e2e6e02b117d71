"""Each mode's fence: it declares its names, options and capabilities, and nothing outside modes/ asks for its name."""

import ast
import os

import pytest

import gpupar
from conftest import ROOT
from gpupar.config import STRATEGY_CHOICES, Distribution
from gpupar.errors import GpuparError
from gpupar.training import modes

MODE_NAMES = {mode.name for mode in modes.MODES} | {"model_parallel", "parameter_server"}
FENCED = (os.path.join("gpupar", "training", "modes"), os.path.join("gpupar", "runtime"))  # runtime: tf.distribute's kinds


def test_the_modes_take_exactly_the_strategy_values_the_config_accepts():
    assert {s for mode in modes.MODES for s in mode.strategies} == set(STRATEGY_CHOICES)


def test_each_mode_declares_only_distribution_fields_as_its_options():
    fields = set(Distribution.field_names())
    for mode in modes.MODES:
        assert set(mode.options) <= fields, mode.name
    owned = [option for mode in modes.MODES for option in mode.options]
    assert len(owned) == len(set(owned))  # no option belongs to two modes


def name_comparisons(source: str) -> list:
    """The string constants naming a mode that take part in a comparison (==, !=, in) in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                for constant in ast.walk(side):
                    if isinstance(constant, ast.Constant) and constant.value in MODE_NAMES:
                        found.append(constant.value)
    return found


def test_no_code_outside_the_modes_compares_a_mode_name():
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "gpupar")):
        if os.path.relpath(folder, ROOT).startswith(FENCED):
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                offenders += [f"{os.path.relpath(path, ROOT)}: {value}" for value in name_comparisons(open(path).read())]
    assert offenders == []


def test_the_comparison_finder_finds_one():
    """Control: a comparison with a mode's name, as the preset and diagnose made before the modes were fenced."""
    assert name_comparisons("if mode.name != 'synchronous':\n    pass\nok = s in ('model_parallel', 'x')") == [
        "synchronous", "model_parallel"]


def test_a_mode_refuses_another_modes_option_by_its_declaration():
    with pytest.raises(GpuparError, match=r"microbatches=4 pipelines the stages of strategy=model_parallel; pass "
                                          r"strategy=model_parallel, or drop microbatches"):
        modes.checked(gpupar.Config(microbatches=4, strategy="mirrored"))
    assert modes.checked(gpupar.Config(microbatches=4, strategy="model_parallel")).distribution.microbatches == 4


def test_a_mode_without_step_options_refuses_them():
    for strategy in ("model_parallel", "parameter_server"):
        mode = modes.select(gpupar.Config(strategy=strategy).distribution)
        assert not mode.takes_step_options
        with pytest.raises(GpuparError, match=f"not available with strategy={strategy}"):
            modes.checked(gpupar.Config(strategy=strategy, jit_compile=True), cluster=_ps_cluster())


def _ps_cluster():
    from gpupar.runtime.cluster import parse_tf_config

    return parse_tf_config('{"cluster": {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"]}, '
                           '"task": {"type": "chief", "index": 0}}')
