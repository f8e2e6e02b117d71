"""benchmarks/bench.py in quick mode, as fresh processes on a small synthetic IDX folder; its pure parts."""

import json
import subprocess
import sys

import pytest

from benchmarks import bench
from conftest import ROOT, make_idx_dir


def test_configurations_cover_fit_default_and_tuned_and_each_option_alone():
    rows = {row.key: row for row in bench.configurations((1, 2, 4))}
    for replicas in (1, 2, 4):
        assert {f"gpupar x{replicas}", f"model.fit x{replicas}", f"model.fit steps_per_execution=10 x{replicas}",
                f"TF1 tower code x{replicas}"} <= set(rows)
    assert dict(rows["gpupar jit_compile x1"].options) == {"jit_compile": True}
    assert dict(rows["model.fit, Keras' BatchNormalization x1"].options) == {"keras_batch_norm": True}
    assert dict(rows["gpupar mixed_bfloat16 x1"].options) == {"precision": "mixed_bfloat16"}
    assert dict(rows["gpupar steps_per_call=1 x1"].options) == {"steps_per_call": 1}
    assert dict(rows["gpupar TensorFlow's threads x2"].options) == {"intra_op_threads": 0, "inter_op_threads": 0}
    assert "gpupar mixed_float16 x1" in {row.key for row in bench.configurations((1,), gpu=True)}
    assert bench.timed_steps(rows["model.fit steps_per_execution=10 x1"], 12) == 20
    assert bench.timed_steps(rows["gpupar x1"], 12) == 12


def test_ratios_are_paired_within_rounds():
    # Round 2 ran on a machine twice as slow: per-round ratios still say 1.5x.
    assert bench._paired_ratio([150, 75, 150], [100, 50, 100]) == pytest.approx(1.5)


@pytest.mark.slow
def test_quick_benchmark_writes_the_table_json_and_plot(tmp_path):
    folder = make_idx_dir(tmp_path / "data")
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", f"--data_dir={folder}", f"--json={out}", f"--plot={png}",
         "--replicas=1,2", "--only=^(gpupar|model.fit|TF1 tower code)$", "--steps=2", "--repeats=2", "--batch_size=16",
         "--accuracy_target=0"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(row["name"], row["replicas"]): row for row in report["configurations"]}
    assert set(rows) == {(name, r) for name in ("gpupar", "model.fit", "TF1 tower code") for r in (1, 2)}
    for (name, replicas), row in rows.items():
        assert len(row["images_per_second"]) == 2 and row["min"] <= row["median"] <= row["max"]
        assert 0 < row["roofline_fraction"] < 1 and row["first_step_seconds"] > 0 and row["cores_busy"] > 0.1
        assert row["peak_memory"]["host_mb"] > 100
    assert rows[("gpupar", 1)]["vs_model_fit"] > 0 and rows[("gpupar", 2)]["vs_one_replica"] > 0
    assert "MirroredStrategy" in rows[("gpupar", 2)]["strategy"] and rows[("gpupar", 1)]["steps_per_call"] == 10
    assert rows[("TF1 tower code", 2)]["strategy"] in ("TF1 towers on /cpu:0, /cpu:1", "TF1 towers on /gpu:0, /gpu:1")
    assert rows[("TF1 tower code", 2)]["vs_one_replica"] > 0
    shares = rows[("gpupar", 1)]["time_shares"]
    assert set(shares) == {"input_wait", "step", "host"} and sum(shares.values()) == pytest.approx(1)
    assert report["op_seconds"]["1"]["convolution"] > 0 and report["op_seconds"]["2"]["all-reduce"] > 0
    assert 2e6 < report["flops_per_image"] < 4e6 and report["matmul"]["float32_flops"] > 1e9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "roofline: 2.95 MFLOP per image" in done.stdout and "where the time goes" in done.stdout
    assert set(report["headlines"]) == {
        "gpupar / model.fit, same model, 1 replica", "gpupar 2 replicas / 1 replica",
        "TF1 tower code 2 towers / 1 tower", "gpupar / TF1 tower code, 1 replica", "gpupar / TF1 tower code, 2 replicas"}
    assert "gpupar 2 replicas / 1 replica: " in done.stdout


def test_time_to_accuracy_stops_at_the_target(tmp_path):
    folder = make_idx_dir(tmp_path / "data", num_train=2048, num_test=100)
    result = bench.time_to_accuracy(folder, target=0.05, max_epochs=3, work_dir=str(tmp_path))
    assert result["reached"] and result["epochs"] == 1 and result["test_accuracy"] >= 0.05
    assert result["seconds"] > result["training_seconds"] > 0


@pytest.mark.parametrize("flag, status, message", [
    ("--data_dir=/nonexistent", 2, "is not a folder"), ("--replicas=1,x", 2, "give replica counts"),
    ("--steps=0", 1, "flag --steps=0: 0 is not a positive integer"), ("--only=(", 2, "not a regular expression"),
    ("--accuracy_target=2", 1, "flag --accuracy_target=2: 2.0 is not a number in the range [0, 1]"),
])
def test_bad_flags_fail_before_any_work(flag, status, message):
    done = subprocess.run([sys.executable, "benchmarks/bench.py", flag], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == status and message in done.stderr, done.stderr
    assert "[bench] starting" not in done.stdout
