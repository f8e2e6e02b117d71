"""The augmentation benchmark in quick mode, as a fresh process on a small synthetic IDX folder."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, make_idx_dir


@pytest.mark.slow
def test_quick_input_benchmark_measures_every_placement(tmp_path):
    folder = make_idx_dir(tmp_path / "data")
    out = tmp_path / "b.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.input", "--data_dir", folder, "--json", str(out),
         "--steps=4", "--repeats=1", "--batch_size=32"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"no augmentation", "augment on host", "augment on device"}
    for values in report["results"].values():
        assert len(values["together_examples_per_second"]) == 1 and values["together_examples_per_second"][0] > 0
    assert "augmentation on the device trains" in done.stdout
