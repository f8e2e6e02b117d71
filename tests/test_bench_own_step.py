"""The own-train_step benchmark in quick mode, as a fresh process: every runner at 1 and 2 replicas."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_quick_own_step_benchmark_trains_every_runner_at_both_replica_counts(tmp_path):
    out = tmp_path / "own_step.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.own_step", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {row["replicas"] for row in rows} == {1, 2} and len(rows) == 4
    assert all(row["examples_per_second"] > 0 for row in rows)
    assert [row["ratio"] is not None for row in rows].count(True) == 2  # gpupar's rows, against model.fit's
    assert "gpupar/fit" in done.stdout
