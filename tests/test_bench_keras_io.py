"""The keras-io benchmark: in quick mode as a fresh process (model.fit and gpupar.fit side by side, float32 and
bfloat16, every kind of program), and its pure parts.

Each combination is a process of its own, so the two quick runs split the work: both precisions at 1
replica, the own train_step and the PyDataset at 2 (the harder case; both replica counts are one loop).
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import keras_io
from conftest import ROOT


def _quick(tmp_path, *flags):
    out = tmp_path / "keras_io.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.keras_io", "--quick", *flags, "--json", str(out)],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


@pytest.mark.slow
def test_quick_keras_io_benchmark_compares_both_runners_in_both_precisions(tmp_path):
    report, stdout = _quick(tmp_path, "--examples=mnist_convnet", "--replicas=1")
    rows = report["rows"]
    assert [(row["example"], row["replicas"], row["precision"]) for row in rows] == [
        ("mnist_convnet", 1, p) for p in ("float32", "mixed_bfloat16")]
    for row in rows:
        assert row["metrics"] == ["val_accuracy"] and row["train_examples"] == 576 and row["val_examples"] == 64
        assert row["fit_examples_per_second"] > 0 and row["gpupar_examples_per_second"] > 0 and row["ratio"] > 0
        assert 0 <= row["fit_quality"]["val_accuracy"] <= 1 and 0 <= row["gpupar_quality"]["val_accuracy"] <= 1
    assert [(row["replicas"], row["runner"]) for row in report["bfloat16"]] == [
        (1, n) for n in ("model.fit", "gpupar.fit")]
    assert all(row["ratio"] > 0 and "val_accuracy" in row["difference"] for row in report["bfloat16"])
    assert "| bf16/f32 |" in stdout and "| gpupar/fit |" in stdout


@pytest.mark.slow
def test_quick_keras_io_benchmark_runs_an_own_train_step_and_a_py_dataset(tmp_path):
    report, _ = _quick(tmp_path, "--examples=dcgan_overriding_train_step,oxford_pets_image_segmentation",
                       "--precisions=float32", "--replicas=2")
    rows = {(row["example"], row["replicas"]): row for row in report["rows"]}
    assert set(rows) == {("dcgan_overriding_train_step", 2), ("oxford_pets_image_segmentation", 2)}
    gan, pets = rows["dcgan_overriding_train_step", 2], rows["oxford_pets_image_segmentation", 2]
    assert gan["metrics"] == ["d_loss", "g_loss"] and gan["train_examples"] == 128 and gan["val_examples"] == 0
    assert pets["metrics"] == ["val_loss"] and pets["train_examples"] == 72 and pets["val_examples"] == 24
    for row in (gan, pets):
        assert row["ratio"] > 0 and all(np.isfinite(v) for v in row["gpupar_quality"].values())
    assert report["bfloat16"] == []  # float32 alone: nothing to compare


def test_quality_is_the_validation_accuracy_else_the_validation_loss_else_the_logged_losses():
    assert keras_io.quality_names({"loss": [1], "accuracy": [0], "val_loss": [1], "val_accuracy": [0]}) == \
        ["val_accuracy"]
    assert keras_io.quality_names({"loss": [1], "val_loss": [1]}) == ["val_loss"]
    assert keras_io.quality_names({"d_loss": [1], "g_loss": [1]}) == ["d_loss", "g_loss"]


def test_examples_are_counted_in_arrays_datasets_and_py_datasets():
    import keras
    import tensorflow as tf

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 3

        def __getitem__(self, index):
            return np.zeros((4 if index < 2 else 1, 2)), np.zeros(4 if index < 2 else 1)

    assert keras_io.count_examples(np.zeros((10, 3))) == 10
    assert keras_io.count_examples(tf.data.Dataset.from_tensor_slices(np.zeros((10, 3))).batch(4)) == 10
    assert keras_io.count_examples(Batches()) == 9
    assert keras_io.training_size(np.zeros((10, 3)), 0.1) == 9


def test_a_combination_that_cannot_run_is_a_row_with_its_reason():
    row = {"example": "text_classification_with_transformer", "kind": "transformer", "replicas": 1,
           "precision": "mixed_bfloat16", "cannot_run": "its ids round in bfloat16"}
    text = keras_io.table({"rows": [row], "bfloat16": [], "scales": {row["example"]: 1}, "repeats": 1, "epochs": 2,
                           "seconds": 1.0, "quick": False})
    assert "| text_classification_with_transformer | transformer | 1 | mixed_bfloat16 | cannot run* |" in text
    assert "* its ids round in bfloat16" in text


@pytest.mark.parametrize("flag, message", [
    ("--replicas=1,3", "--replicas=1,3: choose from 1, 2"),
    ("--precisions=float64", "--precisions=float64: choose from float32, mixed_bfloat16"),
    ("--examples=mnist_convnet,nope", "--examples: unknown nope; choose from "),
], ids=["replicas", "precisions", "examples"])
def test_a_bad_flag_value_is_one_line_and_status_2_before_anything_runs(flag, message, tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.keras_io", flag, "--json", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.startswith(f"benchmarks.keras_io: error: {message}"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "out.json").exists()
