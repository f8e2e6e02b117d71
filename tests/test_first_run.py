"""A new user's first run: TFDS prepares the data for real, outputs land in runs/, help and errors are clear."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gpupar
from gpupar.errors import GpuparError
from gpupar.training.outputs import plan_outputs
from upstream_files import UpstreamProxy


def _gpupar(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "gpupar", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )


def _offline_tfds(tmp_path, proxy_url):
    """An environment where TFDS prepares into tmp_path and reaches the web only through proxy_url."""
    return {"http_proxy": proxy_url, "HTTP_PROXY": proxy_url, "https_proxy": proxy_url, "HTTPS_PROXY": proxy_url,
            "no_proxy": "", "NO_PROXY": "", "TFDS_DATA_DIR": str(tmp_path / "tensorflow_datasets")}


@pytest.mark.slow
def test_first_run_downloads_and_prepares_fashion_mnist_with_tfds(tmp_path):
    """TFDS's own builder downloads (the files it registers checksums for), prepares, loads; one step trains."""
    with UpstreamProxy() as proxy:
        result = _gpupar("--dataset=fashion_mnist", "--epochs=1", "--steps_per_epoch=1", "--per_replica_batch_size=64",
                         env=_offline_tfds(tmp_path, proxy.url), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(proxy.served) == sorted(f"{stem}.gz" for stem in (
        "train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"))
    assert "data: 60000 training images from TFDS fashion_mnist; evaluation: 10000 test images" in result.stdout
    assert os.path.isdir(tmp_path / "tensorflow_datasets" / "fashion_mnist")
    assert result.stdout.strip().splitlines()[-1] == (
        "outputs: checkpoints in runs/001 (latest runs/001/ckpt-1); TensorBoard: tensorboard --logdir "
        "runs/001/tensorboard; metrics: runs/001/metrics.json")


def test_a_missing_package_is_named_not_blamed_on_the_network(tmp_path):
    """The defect as users met it: TFDS's builder imports importlib_resources when it prepares data."""
    script = ("import sys\nsys.modules['importlib_resources'] = None  # as if not installed\n"
              "from gpupar.cli import run\nrun()\n")
    with UpstreamProxy() as proxy:
        result = subprocess.run([sys.executable, "-c", script, "--dataset=fashion_mnist", "--epochs=1"],
                                capture_output=True, text=True, timeout=300,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **_offline_tfds(tmp_path, proxy.url)})
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "TFDS needs the Python package 'importlib_resources', which is not installed" in last
    assert "pip install importlib_resources" in last and "internet" not in last


def test_no_network_is_said_at_once_with_the_way_out(tmp_path):
    result = _gpupar("--dataset=fashion_mnist", "--epochs=1", env=_offline_tfds(tmp_path, "http://127.0.0.1:9"))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "could not download TFDS dataset 'fashion_mnist': no connection to its server" in last
    assert "pass --data_dir" in last


def test_outputs_default_to_a_new_numbered_run_folder():
    from gpupar.config import Config

    fresh = plan_outputs(Config().outputs, ["001", "003", "notes", "fashion_mnist"])
    assert (fresh.model_dir, fresh.log_dir, fresh.metrics_json, fresh.warning) == (
        "runs/004", "runs/004/tensorboard", "runs/004/metrics.json", None)
    assert plan_outputs(Config(resume=True).outputs, ["001", "003"]).model_dir == "runs/003"  # the latest
    first = plan_outputs(Config(resume=True).outputs, [])
    assert first.model_dir == "runs/001" and "no earlier run under runs/" in first.warning
    given = plan_outputs(Config(model_dir="here", log_dir="tb").outputs, [])
    assert (given.model_dir, given.log_dir, given.metrics_json) == ("here", "tb", "here/metrics.json")
    nothing = plan_outputs(Config(save=False).outputs, ["001"])
    assert (nothing.model_dir, nothing.log_dir, nothing.metrics_json) == (None, None, None)


def test_runs_keep_their_outputs_and_resume_takes_the_latest(shared_idx_dir, tmp_path, caplog):
    options = dict(data_dir=shared_idx_dir, per_replica_batch_size=64, steps_per_epoch=2, display_step=100)
    first = gpupar.fit_mnist(epochs=1, **options)
    second = gpupar.fit_mnist(epochs=1, **options)
    assert first.checkpoint == "runs/001/ckpt-1" and second.checkpoint == "runs/002/ckpt-1"
    assert sorted(os.listdir(tmp_path / "runs" / "002")) == [
        ".gpupar.lock", "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index", "metrics.json", "tensorboard"]
    resumed = gpupar.fit_mnist(epochs=2, resume=True, **options)
    assert resumed.start_epoch == 1 and resumed.checkpoint == "runs/002/ckpt-2"
    assert "outputs: checkpoints in runs/002 (latest runs/002/ckpt-2)" in caplog.text
    assert [r["epoch"] for r in json.loads((tmp_path / "runs/002/metrics.json").read_text())["history"]] == [0, 1]


def test_save_false_writes_nothing_and_says_so(shared_idx_dir, tmp_path):
    result = _gpupar(f"--data_dir={shared_idx_dir}", "--epochs=1", "--steps_per_epoch=1", "--per_replica_batch_size=64",
                     "--nosave")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "outputs: none written (save=False)"
    assert not os.path.exists(tmp_path / "runs")


def test_resume_with_a_mistyped_model_dir_warns(shared_idx_dir, tmp_path, caplog):
    gpupar.fit_mnist(data_dir=shared_idx_dir, epochs=1, per_replica_batch_size=64, steps_per_epoch=1,
                     model_dir=str(tmp_path / "run"))
    result = gpupar.fit_mnist(data_dir=shared_idx_dir, epochs=1, per_replica_batch_size=64, steps_per_epoch=1,
                              model_dir=str(tmp_path / "rnu"), resume=True)
    assert result.start_epoch == 0
    assert f"resume: model_dir='{tmp_path / 'rnu'}' does not exist (check the path)" in caplog.text
    assert any(r.levelname == "WARNING" and "does not exist" in r.message for r in caplog.records)


@pytest.mark.parametrize("command, says", [
    ((), "Trains as the flags say"), (("diagnose",), "Measures the input pipeline alone"),
    (("devices",), "Lists the devices TensorFlow sees"), (("plot",), "Draws loss, accuracy and speed"),
    (("launch",), "gpupar cluster on this machine")])
def test_help_says_what_each_command_does(command, says):
    result = _gpupar(*command, "--help", timeout=60)
    assert result.returncode == 0 and says in result.stdout, result.stderr
    if not command:
        assert "--epochs=... (default 5)" in result.stdout and "--[no]save (default True)" in result.stdout
        assert all(f"  {name} " in result.stdout for name in ("devices", "diagnose", "plot", "launch"))
        assert "absl.app" not in result.stdout  # none of absl's own flags


def test_a_resumed_epoch_is_reported_whole(shared_idx_dir, tmp_path):
    """Interrupted at step 15 of 16 and resumed: the record covers all 16 steps, as if never stopped."""
    options = dict(data_dir=shared_idx_dir, epochs=1, per_replica_batch_size=16, dropout=0.0, display_step=100)
    straight = gpupar.fit_mnist(save=False, **options).records[0]
    model_dir = str(tmp_path / "run")
    gpupar.fit_mnist(model_dir=model_dir, checkpoint_every_steps=5, **options)  # saves steps 5, 10 and 15
    resumed = gpupar.fit_mnist(model_dir=model_dir, resume=f"{model_dir}/within_epoch/step-15", **options).records[0]
    assert (resumed.steps, resumed.resumed_at_step, straight.resumed_at_step) == (16, 15, 0)
    assert resumed.train_loss == pytest.approx(straight.train_loss, abs=1e-5)
    assert resumed.train_accuracy == pytest.approx(straight.train_accuracy, abs=1e-6)
    assert resumed.seconds > 0 and resumed.examples_per_second == pytest.approx(16 * 16 / resumed.seconds)


def test_a_checkpoint_names_the_model_that_wrote_it(shared_idx_dir, tmp_path):
    model_dir = tmp_path / "run"
    gpupar.fit_mnist(data_dir=shared_idx_dir, epochs=1, per_replica_batch_size=64, steps_per_epoch=1, model="lstm",
                     lstm_layers=1, lstm_units=8, model_dir=str(model_dir))
    before = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}
    with pytest.raises(GpuparError) as e:
        gpupar.fit_mnist(data_dir=shared_idx_dir, epochs=2, per_replica_batch_size=64, steps_per_epoch=1,
                         model_dir=str(model_dir), resume=True)
    assert (f"{model_dir}/ckpt-1 was written by model lstm (lstm_layers=1, lstm_units=8), but this run builds "
            "model convnet") in str(e.value)
    assert {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()} == before


def test_dir_lists_the_lazily_imported_names():
    assert {"make_strategy", "build_convnet", "configure_devices", "fit_mnist", "Config"} <= set(dir(gpupar))


def test_an_array_in_an_option_is_quoted_by_type_and_shape():
    x, y = np.zeros((5, 28, 28), np.uint8), np.zeros(5, np.int32)
    with pytest.raises(GpuparError) as e:
        gpupar.fit_mnist(dataset=(x, y))
    assert "dataset=(<ndarray of shape (5, 28, 28)>, <ndarray of shape (5,)>) is unknown" in str(e.value)
    assert len(str(e.value)) < 300


def test_the_plot_has_whole_epochs_labels_and_a_title():
    from gpupar.commands.plot import draw_history

    history = [{"epoch": e, "logs": {"loss": 1.0 / (e + 1), "accuracy": 0.5, "val_loss": 1.2, "val_accuracy": 0.6},
                "examples_per_second": 1000.0} for e in range(3)]
    figure = draw_history(history, "runs/001/metrics.json: MirroredStrategy")
    figure.canvas.draw()
    assert figure._suptitle.get_text() == "runs/001/metrics.json: MirroredStrategy"
    for axes in figure.axes:
        assert axes.get_ylabel() and axes.get_xlabel() == "epoch"
        assert all(float(t).is_integer() for t in axes.get_xticks())


def _quick_start():
    """The lines of the README's first sh block: the quick start."""
    from conftest import ROOT

    text = open(os.path.join(ROOT, "README.md")).read()
    block = text[text.index("```sh\n") + len("```sh\n"):]
    return [line.split("  #")[0].strip() for line in block[:block.index("```")].splitlines() if line.strip()]


@pytest.mark.slow
def test_the_readme_quick_start_runs_as_written(tmp_path):
    lines = _quick_start()
    assert len(lines) <= 5
    setup, install = lines[0], next(line for line in lines if "pip install" in line)
    assert "apt-get update" in setup.split("apt-get install")[0] and "dataset-fashion-mnist" in setup
    runs = [line for line in lines if line.startswith(".venv/bin/gpupar")]
    assert any(" plot " in line for line in runs) and "'.[plot]'" in install  # gpupar plot needs matplotlib
    venv_bin = os.path.dirname(sys.executable)
    for line in runs:  # as written, from a fresh folder, with this checkout's .venv
        done = subprocess.run(line.replace(".venv/bin/", venv_bin + "/"), shell=True, cwd=tmp_path, text=True,
                              capture_output=True, timeout=600, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        assert done.returncode == 0, f"{line}\n{done.stderr[-2000:]}"
    assert (tmp_path / "runs" / "001" / "ckpt-2.index").exists() and (tmp_path / "curves.png").stat().st_size > 10_000
