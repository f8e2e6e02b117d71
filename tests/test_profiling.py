"""The profile window: calls cut at its edges, a real capture of the chosen steps, and its op time by kind."""

import glob
import os

import gpupar
import pytest

from benchmarks.ops import op_seconds
from gpupar.monitor.profiling import ProfileWindow


def test_calls_are_cut_at_the_window_edges():
    window = ProfileWindow((5, 8), "/unused")
    assert window.limit(0, 10) == 4  # stop before step 5 to start the profiler
    assert window.limit(4, 10) == 4  # steps 5..8, then stop it
    assert window.limit(8, 10) == 10
    assert ProfileWindow(None, None).limit(0, 10) == 10


def test_profile_of_chosen_steps_lands_in_log_dir(shared_idx_dir, tmp_path, capsys):
    log_dir = str(tmp_path / "tb")
    gpupar.fit_mnist(data_dir=shared_idx_dir, epochs=1, per_replica_batch_size=32, steps_per_call=4, log_dir=log_dir,
                     profile_steps="2,3")
    assert "profiled steps 2..3 of this run into" in capsys.readouterr().out
    assert glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))
    # The profile's op time by kind: the ConvNet's convolutions, its XLA batch norm, the input.
    seconds = op_seconds(log_dir)
    assert seconds["convolution"] > 0 and seconds["XLA kernels (batch norm)"] > 0 and seconds["pooling"] > 0
    assert "all-reduce" not in seconds  # one replica


def test_op_seconds_without_a_profile_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        op_seconds(str(tmp_path))
