"""The keras-io benchmark in quick mode on one example, as a fresh process: model.fit and gpupar.fit side by side."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_quick_keras_io_benchmark_compares_both_runners_at_both_replica_counts(tmp_path):
    out = tmp_path / "keras_io.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.keras_io", "--quick", "--examples=mnist_convnet",
                           "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["example"], row["replicas"]) for row in rows] == [("mnist_convnet", 1), ("mnist_convnet", 2)]
    for row in rows:
        assert row["fit_examples_per_second"] > 0 and row["gpupar_examples_per_second"] > 0
        assert 0 <= row["fit_val_accuracy"] <= 1 and 0 <= row["gpupar_val_accuracy"] <= 1
