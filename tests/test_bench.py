"""The benchmark in quick mode, as a fresh process on a small synthetic IDX folder."""

import json
import subprocess
import sys

from conftest import make_idx_dir


def test_quick_benchmark_writes_every_configuration(tmp_path):
    folder = make_idx_dir(tmp_path / "data")
    out = tmp_path / "b.json"
    done = subprocess.run(
        [sys.executable, "-m", "gpupar.bench", "--data_dir", folder, "--json", str(out),
         "--steps=2", "--repeats=1", "--batch_size=16"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    report = json.loads(out.read_text())
    rows = {(row["name"], row["replicas"]): row for row in report["configurations"]}
    expected = {(name, replicas) for name in ("gpupar K=1", "gpupar K=10", "model.fit") for replicas in (1, 2)}
    assert set(rows) == expected
    for (name, replicas), row in rows.items():
        assert row["global_batch"] == 16 * replicas
        assert len(row["images_per_second"]) == 1
        assert all(value > 0 for value in row["images_per_second"])
    assert report["batch_size"] == 16 and report["steps"] == 2 and report["repeats"] == 1
    assert {"nproc", "tensorflow", "keras"} <= set(report["machine"])

    assert "gpupar/model.fit (median), 1 replica:" in done.stdout
    assert "gpupar/model.fit (median), 2 replicas:" in done.stdout
    assert "OneDeviceStrategy" in done.stdout and "MirroredStrategy" in done.stdout


def test_missing_data_dir_is_a_clear_error(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "gpupar.bench", "--data_dir", str(tmp_path / "nothing"), "--json", str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2
    assert "gpupar.bench: error:" in done.stderr and "pass --data_dir" in done.stderr
