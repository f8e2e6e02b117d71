"""make results in quick mode, as a fresh process on a small synthetic IDX folder: its tables with their commit,
command, date and machine; and every benchmark command it runs."""

import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import results
from conftest import ROOT, make_idx_dir


@pytest.mark.slow
def test_quick_results_write_each_table_with_its_commit_command_date_and_machine(tmp_path):
    """make train's table and diagnose's, which no other test runs through benchmarks.results; diagnose's JSON too.

    The five benchmarks' quick runs are their own tests' (tests/test_bench*.py); running them here
    again took four minutes of the suite. Their commands' flags are checked below.
    """
    folder = make_idx_dir(tmp_path / "data")
    out, work = tmp_path / "out", tmp_path / "work"
    done = subprocess.run([sys.executable, "-m", "benchmarks.results", "--quick", "--only=train,diagnose",
                           f"--data_dir={folder}", f"--out_dir={out}", f"--work_dir={work}"],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    written = json.loads((out / "RESULTS.json").read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    assert written["quick"] and written["machine"]["cores"] >= 1 and written["machine"]["tensorflow"][0] == "2"
    assert [table["name"] for table in written["tables"]] == ["train", "diagnose"]
    for table in written["tables"]:
        assert "failed" not in table and table["commit"] == commit and isinstance(table["dirty"], bool)
        assert table["command"].startswith(sys.executable) and table["date"].endswith("UTC")
        assert "| --- |" in table["markdown"] and table["report"]
    markdown = (out / "RESULTS.md").read_text()
    assert "no figure here is a result" in markdown and markdown.count("```sh") == 2
    assert "TensorFlow 2." in markdown and f"Commit {commit}" in markdown
    assert "--epochs=1 --steps_per_epoch=2" in markdown and "| epoch | loss |" in markdown  # make train's table
    assert (work / "train" / "checkpoint").exists()
    # `gpupar diagnose --json`: its standard output is the JSON alone (the run above parsed all of it), for machines.
    report = written["tables"][1]["report"]
    assert set(report) >= {"input_examples_per_second", "step_examples_per_second", "together_examples_per_second",
                           "input_wait_fraction", "input_bound", "bound_by", "recommendations"}
    assert report["steps"] == 4 and report["global_batch"] == 64
    assert set(report["precisions"]) <= {"float32", "mixed_bfloat16", "mixed_float16"}


@pytest.mark.parametrize("quick", [False, True])
def test_every_benchmark_command_passes_only_flags_its_module_defines(quick):
    for table in results.tables("/data", "runs/results", quick=quick):
        module = table.command[2]
        if module == "gpupar":
            continue  # make train's and diagnose's flags: run above
        with open(os.path.join(ROOT, *module.split(".")) + ".py") as f:
            source = f.read()
        defined = set(re.findall(r'DEFINE_\w+\(\s*"(\w+)"', source))
        passed = {arg[2:].split("=")[0] for arg in table.command[3:]}
        assert passed and passed <= defined, (table.name, passed - defined)


def test_a_bad_table_name_is_refused_before_anything_runs(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.results", "--only=train,nonsense",
                           f"--out_dir={tmp_path}"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "--only=train,nonsense: choose from train, keras_io" in done.stderr
    assert not (tmp_path / "RESULTS.md").exists()


def test_the_full_run_runs_make_train_and_every_benchmark_at_its_full_size():
    commands = {table.name: table.command for table in results.tables("/data", "runs/results", quick=False)}
    assert commands["train"][2:] == ["gpupar", "--dataset=fashion_mnist", "--data_dir=/data", "--epochs=5",
                                     "--model_dir=runs/results/train", "--log_dir=runs/results/train/tensorboard",
                                     "--metrics_json=runs/results/train.json"]
    assert commands["keras_io"][2:] == ["benchmarks.keras_io", "--json=runs/results/keras_io.json"]
    assert "--repeats=3" in commands["bench"] and not any("quick" in arg for c in commands.values() for arg in c)
