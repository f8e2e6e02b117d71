"""The gpupar command: flags map onto Config; errors are one line and an exit status."""

import dataclasses
import json
import os
import subprocess
import sys
import types

import pytest

from gpupar import cli
from gpupar.presets.mnist_options import mnist_options

FLAGS = cli.FLAGS


def _flat(config, preset):
    """Every option of a Config and the MNIST preset's options, by its flat name."""
    return types.SimpleNamespace(**config.options(), **dataclasses.asdict(preset))


@pytest.fixture
def parse():
    def _parse(*args):
        FLAGS.unparse_flags()
        FLAGS(["gpupar", *args])
        return _flat(*cli.config_from_flags())

    yield _parse
    FLAGS.unparse_flags()


def _gpupar(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "gpupar", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )


def test_no_flags_give_the_default_config(parse):
    assert parse() == _flat(*mnist_options())  # the presets' defaults: the command trains the MNIST ConvNet


def test_flags_map_onto_the_config(parse, shared_idx_dir):
    c = parse("--strategy=mirrored", "--virtual_cpus=2", "--epochs=3", "--batch_size=64", "--gpus=0,1",
              "--memory_growth", "--nosoft_placement", "--learning_rate=0.01", f"--data_dir={shared_idx_dir}",
              "--steps_per_epoch=7", "--devices=/cpu:0,/cpu:1")
    assert (c.strategy, c.virtual_cpus, c.epochs, c.batch_size, c.gpus) == ("mirrored", 2, 3, 64, (0, 1))
    assert c.memory_growth and not c.soft_placement and c.learning_rate == 0.01
    assert (c.data_dir, c.steps_per_epoch, c.devices) == (shared_idx_dir, 7, ("/cpu:0", "/cpu:1"))


def test_the_other_flags_map_onto_the_config(parse, tmp_path):
    c = parse("--dataset=fashion_mnist", "--cross_device_ops=hierarchical_copy", "--memory_limit_mb=512",
              "--log_placement", f"--model_dir={tmp_path}", "--max_to_keep=2", "--checkpoint_every_steps=50",
              f"--log_dir={tmp_path}/tb", "--display_step=3", "--steps_per_call=4", "--nan_policy=skip",
              "--dropout=0.25", "--sync_batch_norm", "--seed=9", f"--metrics_json={tmp_path}/m.json")
    expected = dict(dataset="fashion_mnist", cross_device_ops="hierarchical_copy", memory_limit_mb=512,
                    log_placement=True, model_dir=str(tmp_path), max_to_keep=2, checkpoint_every_steps=50,
                    log_dir=f"{tmp_path}/tb", display_step=3, steps_per_call=4, nan_policy="skip", dropout=0.25,
                    sync_batch_norm=True, seed=9, metrics_json=f"{tmp_path}/m.json")
    assert {k: getattr(c, k) for k in expected} == expected
    assert parse("--memory_fraction=0.5").memory_fraction == 0.5


def test_input_pipeline_flags_map_onto_the_config(parse, tmp_path):
    c = parse("--augment", "--augment_on=host", "--num_parallel_calls=3", "--nodeterministic", "--data_threads=2",
              f"--log_dir={tmp_path}", "--profile_steps=20,40")
    assert (c.augment, c.augment_on, c.num_parallel_calls, c.deterministic, c.data_threads, c.profile_steps) == (
        True, "host", 3, False, 2, (20, 40))
    defaults = parse()
    assert (defaults.augment, defaults.augment_on, defaults.num_parallel_calls, defaults.deterministic) == (
        False, "device", None, True)


def test_resume_flags(parse, tmp_path):
    assert parse("--resume", f"--model_dir={tmp_path}").resume is True
    (tmp_path / "ckpt-3.index").write_bytes(b"")
    assert parse(f"--resume_from={tmp_path}/ckpt-3").resume == f"{tmp_path}/ckpt-3"


def test_bad_value_fails_before_tensorflow_starts():
    result = _gpupar("--epochs=-1", "--strategy=mirrored")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "gpupar: error: epochs=-1: must be a whole number >= 0"
    assert "strategy:" not in result.stdout


def test_unknown_flag_and_bad_type_fail_before_any_work():
    for flag in ("--epoch=3", "--batch_size=many"):
        result = _gpupar(flag)
        assert result.returncode != 0 and "Flags parsing error" in result.stderr
        assert result.stdout == ""


def test_stray_argument_is_an_error():
    result = _gpupar("train")
    assert result.returncode == 2 and "unexpected argument 'train'; commands are devices, diagnose, plot, launch" in result.stderr


def test_training_failure_is_one_line_and_exit_1(idx_dir):
    os.remove(os.path.join(idx_dir, "train-labels-idx1-ubyte.gz"))
    result = _gpupar(f"--data_dir={idx_dir}", "--epochs=1")
    assert result.returncode == 1
    assert "train-labels-idx1-ubyte[.gz]: file not found" in result.stderr.strip().splitlines()[-1]


def test_cli_trains_and_writes_metrics_json(shared_idx_dir, tmp_path):
    metrics = tmp_path / "metrics.json"
    result = _gpupar(f"--data_dir={shared_idx_dir}", "--epochs=2", "--per_replica_batch_size=16", "--steps_per_epoch=3",
                     "--strategy=mirrored", "--virtual_cpus=2", f"--model_dir={tmp_path / 'run'}",
                     f"--metrics_json={metrics}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "strategy: MirroredStrategy on /cpu:0, /cpu:1 (2 replicas)" in result.stdout
    assert "Epoch:[1] [3 / 3] loss:" in result.stdout
    saved = json.loads(metrics.read_text())
    assert saved["replicas"] == 2 and saved["global_batch"] == 32
    assert [r["epoch"] for r in saved["history"]] == [0, 1] and saved["checkpoint"].endswith("ckpt-2")


def _merged_output(*args, **env):
    clean = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-m", "gpupar", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300, env={**clean, **env})


@pytest.mark.slow
def test_a_plain_run_starts_with_gpupars_own_lines(shared_idx_dir):
    run = [f"--data_dir={shared_idx_dir}", "--epochs=1", "--steps_per_epoch=1", "--per_replica_batch_size=16", "--nosave"]
    quiet = _merged_output(*run)
    assert quiet.returncode == 0, quiet.stdout[-2000:]
    assert quiet.stdout.splitlines()[0].startswith("strategy: OneDeviceStrategy"), quiet.stdout[:2000]
    # absl's --verbosity brings TensorFlow's start-up lines back.
    loud = _merged_output(*run, "--verbosity=0")
    lines = loud.stdout.splitlines()
    assert loud.returncode == 0 and not lines[0].startswith("strategy: ")
    assert any(line.startswith("strategy: ") for line in lines)


def test_a_failed_start_shows_what_tensorflow_said(tmp_path):
    """The held start-up lines are shown when TensorFlow cannot start (here: it is not importable)."""
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(
        "import sys\nsys.stderr.write('tensorflow says: broken install\\n')\nraise ImportError('no TensorFlow')\n")
    result = _merged_output("--epochs=1", PYTHONPATH=str(tmp_path))
    assert result.returncode != 0 and "tensorflow says: broken install" in result.stdout


def test_the_flags_page_is_current():
    """docs/flags.md is generated from Config (make docs): a field or help text changed without it fails here."""
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "flags.md")) as f:
        assert f.read() == cli.flags_markdown(), "docs/flags.md is stale: run make docs"
    assert all(f"`--{name}" in cli.flags_markdown() or f"`--[no]{name}`" in cli.flags_markdown()
               for name in ("epochs", "save", "model_dir", "microbatches", "workers"))
