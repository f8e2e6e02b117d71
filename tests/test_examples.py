"""Every example runs, in its quick mode, so none can rot."""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted(pathlib.Path(__file__).parent.parent.joinpath("examples").glob("*.py"))
SLOW = ("model_parallel.py", "multi_worker.py", "parameter_server.py",  # several processes or many traces
        "input_bound.py", "sync_multi_device.py", "one_device_checkpoints.py", "gan.py", "multi_input.py")  # over 10 s each here


@pytest.mark.parametrize("script", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW else p
                                    for p in EXAMPLES], ids=[p.name for p in EXAMPLES])
def test_example_runs_in_quick_mode(script):
    result = subprocess.run(
        [sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip()  # each example prints what it showed
