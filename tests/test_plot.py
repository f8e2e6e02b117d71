"""`gpupar plot`: a PNG of the expected size from a real metrics file; bad files are clear errors."""

import json
import struct
import subprocess
import sys

import pytest

from gpupar.errors import GpuparError
from gpupar.commands.plot import HEIGHT, WIDTH, load_history, plot_history


def _png_size(path):
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR"
    return struct.unpack(">II", header[16:24])


def test_plot_of_a_real_metrics_file(shared_idx_dir, tmp_path):
    import gpupar

    metrics = tmp_path / "metrics.json"
    gpupar.fit_mnist(data_dir=shared_idx_dir, epochs=2, batch_size=16, steps_per_epoch=3, metrics_json=str(metrics),
                     display_step=100)
    output = tmp_path / "curves.png"
    result = subprocess.run([sys.executable, "-m", "gpupar", "plot", str(metrics), "-o", str(output)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert _png_size(output) == (WIDTH, HEIGHT)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not JSON"),
        (json.dumps({"logs": {"val_accuracy": 0.9}}), "no per-epoch 'history' list"),
        (json.dumps({"history": []}), "no per-epoch 'history' list"),
        (json.dumps({"history": [{"epoch": 0, "logs": {"accuracy": 1.0}}]}),
         "history[0] lacks number(s) examples_per_second, logs.loss"),
    ],
)
def test_malformed_metrics_are_clear_errors(tmp_path, content, message):
    path = tmp_path / "metrics.json"
    path.write_text(content)
    with pytest.raises(GpuparError) as e:
        load_history(str(path))
    assert str(e.value).startswith(str(path)) and message in str(e.value)


def test_missing_metrics_file_from_the_command(tmp_path):
    result = subprocess.run([sys.executable, "-m", "gpupar", "plot", str(tmp_path / "none.json")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "none.json: cannot read it (No such file or directory)" in result.stderr


def test_plot_history_writes_the_size_it_promises(tmp_path):
    history = [{"epoch": e, "logs": {"loss": 1.0 / (e + 1), "val_loss": 1.1, "accuracy": 0.5, "val_accuracy": 0.6},
                "examples_per_second": 1000.0} for e in range(3)]
    plot_history(history, str(tmp_path / "c.png"))
    assert _png_size(tmp_path / "c.png") == (WIDTH, HEIGHT)


def test_unwritable_output_is_a_clear_error(tmp_path):
    history = [{"epoch": 0, "logs": {"loss": 1.0}, "examples_per_second": 1.0}]
    (tmp_path / "file").write_text("")
    with pytest.raises(GpuparError, match="cannot write the plot"):
        plot_history(history, str(tmp_path / "file" / "c.png"))
