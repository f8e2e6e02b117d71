"""Device decisions, tested with fake GPU lists; and the runtime call on this machine."""

import pytest

from gpupar.config import Config
from gpupar.runtime.devices import configure_devices, plan_devices, plan_threads
from gpupar.errors import GpuparError


def test_without_gpus_gpu_settings_are_reported_ignored():
    plan = plan_devices(0, gpus=[0], memory_growth=True, memory_limit_mb=100, virtual_cpus=2)
    assert plan.visible_gpus == () and plan.virtual_cpus == 2
    assert plan.ignored == (
        "gpus ignored: this machine has no GPU",
        "memory_growth ignored: this machine has no GPU",
        "memory_limit_mb ignored: this machine has no GPU",
    )


def test_all_gpus_visible_by_default():
    assert plan_devices(4).visible_gpus == (0, 1, 2, 3)


def test_visible_gpus_by_index():
    plan = plan_devices(4, gpus=[2, 0], memory_growth=True)
    assert plan.visible_gpus == (2, 0) and plan.memory_growth and plan.memory_limits_mb is None


def test_missing_gpu_index_is_a_clear_error():
    with pytest.raises(GpuparError, match="no GPU with index 2; this machine has 2 GPU"):
        plan_devices(2, gpus=[0, 2])


def test_memory_limit_per_visible_gpu():
    assert plan_devices(2, memory_limit_mb=4000).memory_limits_mb == (4000, 4000)


def test_memory_fraction_from_each_gpus_total():
    plan = plan_devices(3, gpus=[1, 2], memory_fraction=0.5, gpu_memory_mb=[8000, 16000, 24000])
    assert plan.memory_limits_mb == (8000, 12000)


def test_memory_fraction_without_totals_fails_clearly():
    with pytest.raises(GpuparError, match="install nvidia-ml-py"):
        plan_devices(1, memory_fraction=0.5, gpu_memory_mb=[None])


def test_limit_wins_over_growth_and_says_so():
    plan = plan_devices(1, memory_growth=True, memory_limit_mb=1000)
    assert not plan.memory_growth and "memory_growth ignored" in plan.ignored[0]


def test_virtual_cpus_share_the_cores_and_run_side_by_side():
    assert plan_threads(cores=2, num_gpus=0, virtual_cpus=2) == (1, 2)
    assert plan_threads(cores=8, num_gpus=0, virtual_cpus=2) == (4, 8)
    assert plan_threads(cores=2, num_gpus=0, virtual_cpus=4) == (1, 4)


def test_tensorflows_thread_defaults_stay_for_one_cpu_or_gpus_and_given_counts_win():
    assert plan_threads(cores=2, num_gpus=0, virtual_cpus=None) == (0, 0)
    assert plan_threads(cores=2, num_gpus=2, virtual_cpus=2) == (0, 0)
    assert plan_threads(cores=2, num_gpus=0, virtual_cpus=2, intra=0, inter=0) == (0, 0)
    assert plan_threads(cores=2, num_gpus=0, virtual_cpus=2, intra=2) == (2, 2)
    plan = plan_devices(0, virtual_cpus=2, cores=4)
    assert (plan.intra_op_threads, plan.inter_op_threads) == (2, 4)


THREADS = """
import os, sys
import tensorflow as tf
from gpupar.config import Config
from gpupar.runtime.devices import configure_devices, plan_threads
configure_devices(Config(virtual_cpus=2))
expected = plan_threads(len(os.sched_getaffinity(0)), 0, 2)
actual = (tf.config.threading.get_intra_op_parallelism_threads(), tf.config.threading.get_inter_op_parallelism_threads())
tf.constant(1.0) + 1  # the runtime starts with them
print("threads", actual == expected, len(tf.config.list_logical_devices("CPU")))
"""


def test_thread_pools_are_set_before_tensorflow_starts():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", THREADS], capture_output=True, text=True, timeout=120)
    assert "threads True 2" in done.stdout, done.stdout + done.stderr[-2000:]


def test_configured_runtime_accepts_what_it_can_still_honour(capsys):
    # conftest made 4 virtual CPUs; asking for 2 uses two of them.
    plan = configure_devices(Config(virtual_cpus=2))
    assert plan.virtual_cpus == 2
    assert "already initialised with 4 logical CPU(s); using 2" in capsys.readouterr().out


def test_configured_runtime_refuses_what_it_cannot_change():
    with pytest.raises(GpuparError, match="already initialised its devices"):
        configure_devices(Config(virtual_cpus=8))
