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
    # model.fit at its best (steps_per_execution=10, float32 alone) runs at 1 replica, and the limit is a fraction.
    plain, fast = rows
    assert plain["tuned_examples_per_second"] > 0 and plain["best_ratio"] > 0 and "tuned_failed" not in plain
    assert "tuned_examples_per_second" not in fast and "best_ratio" not in fast
    assert report["flops_per_example"]["mnist_convnet"] > 1e6
    for row in rows + report["bfloat16"]:
        limits = [v for k, v in row.items() if k.endswith("_limit")]
        assert limits and all(0 < v < 1 for v in limits), row
    assert f"| {keras_io.NAMES['tuned']} ex/s |" in stdout and "| limit: bfloat16 |" in stdout


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
        # model.fit at its best under MirroredStrategy: it ran, or the row says its one-line error.
        assert row["best_ratio"] > 0
        assert row.get("tuned_examples_per_second", 0) > 0 or "Error" in row["tuned_failed"].split(":")[0]
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
                           "seconds": 1.0, "quick": False, "flops_per_example": {row["example"]: 2.5e6},
                           "peak_flops_per_second": {"float32": 1e11, "mixed_bfloat16": 4e11}, "peaks": [{}]})
    assert "| text_classification_with_transformer | transformer | 1 | mixed_bfloat16 | cannot run* |" in text
    assert "* its ids round in bfloat16" in text
    assert "text_classification_with_transformer 2.5 MFLOP) over this machine's matrix-multiply rate in the precision " \
           "it ran in (float32 100 GFLOP/s, bfloat16 400 GFLOP/s" in text


def test_model_fit_at_its_best_that_fails_is_a_row_with_its_error_against_the_default():
    def run(rate, **more):
        return {"examples_per_second": rate, "quality": {"val_accuracy": 0.5}, **more}

    fit, ours = [run(100.0), run(120.0)], [run(150.0), run(150.0)]
    failed = [{"failed": "InvalidArgumentError: You must feed a value for placeholder tensor"}] * 2
    assert keras_io._best(fit, failed) is fit
    assert keras_io._tuned(failed, fit, ours) == {"tuned_failed": failed[0]["failed"], "best_ratio": 1.375}
    faster = [run(200.0), run(100.0)]  # the best in each round: 200 in the first, 120 in the second
    assert [r["examples_per_second"] for r in keras_io._best(fit, faster)] == [200.0, 120.0]
    assert keras_io._tuned(faster, keras_io._best(fit, faster), ours)["best_ratio"] == (0.75 + 1.25) / 2
    row = {"example": "mnist_convnet", "replicas": 2, "fit_examples_per_second": 110.0,
           "gpupar_examples_per_second": 150.0, "difference": {"val_accuracy": 0.0}, "fit_limit": 0.01,
           "best_limit": 0.01, "gpupar_limit": 0.015, **keras_io._tuned(failed, fit, ours)}
    text = "\n".join(keras_io._best_table([row]))
    assert "| mnist_convnet | 2 | 110 | fails† | 150 | 1.38x | +0.0000 | 1.0% | 1.5% |" in text
    assert "† model.fit, steps_per_execution=10 fails here: InvalidArgumentError: You must feed" in text


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


def test_a_failure_is_one_line_naming_tensorflows_root_error_not_its_call_stack():
    import tensorflow as tf

    message = ("Graph execution error:\n\nDetected at node while/cond/Placeholder_1 defined at (most recent call last):\n"
               '  File "trainer.py", line 399, in fit\n\n2 root error(s) found.\n  (0) INVALID_ARGUMENT:  You must feed '
               "a value for placeholder tensor 'while/cond/Placeholder_1' with dtype int32\n\t [[{{node x}}]]\n")
    assert keras_io.failure(tf.errors.InvalidArgumentError(None, None, message)) == (
        "InvalidArgumentError: You must feed a value for placeholder tensor 'while/cond/Placeholder_1' with dtype int32")
    assert keras_io.failure(ValueError("the batch is empty\nmore detail")) == "ValueError: the batch is empty"


def test_a_profile_counts_each_op_kind_by_its_own_time_not_its_nested_ops():
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from benchmarks import step_profile

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    for number, name in enumerate(["while:While", "dense/MatMul:_MklMatMul", "ExecutorState::Process"], start=1):
        plane.event_metadata[number].id, plane.event_metadata[number].name = number, name
    line = plane.lines.add()
    for metadata, start, duration in ((1, 0, 10), (2, 2, 3), (2, 6, 2), (3, 20, 4)):  # two MatMuls inside the While
        line.events.add(metadata_id=metadata, offset_ps=start * 10**12, duration_ps=duration * 10**12)
    space.planes.add(name="/device:GPU:0").lines.add().events.add(metadata_id=1, duration_ps=10**15)  # not the host
    seconds, events = step_profile.self_times(space)
    assert seconds == {"While": 5.0, "_MklMatMul": 5.0, "Process": 4.0}
    assert events == {"While": 1, "_MklMatMul": 2, "Process": 1}


@pytest.mark.parametrize("flag, message", [
    ("--examples=mnist_convnet,nope", "--examples: unknown nope; choose from "),
    ("--scale=0", "flag --scale=0: 0 is not"),
], ids=["examples", "scale"])
def test_a_bad_step_profile_flag_is_one_line_and_status_2_before_anything_runs(flag, message, tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", flag, "--json", str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert not (tmp_path / "out.json").exists()
    if flag.startswith("--examples"):  # benchmarks.script's UsageError: one line, status 2 (absl's own for --scale)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
