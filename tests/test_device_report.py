"""`gpupar devices`: the report from fake device lists, and the real command's JSON here."""

import json
import os
import subprocess
import sys

from gpupar.commands.device_report import NO_GPU_HINT, build_report, format_report
from gpupar.runtime.strategy import plan_strategy

VERSIONS = {"tensorflow": "2.x", "keras": "3.x", "built_with_cuda": True}


def test_report_of_a_two_gpu_machine():
    physical = [("/physical_device:CPU:0", "CPU"), ("/physical_device:GPU:0", "GPU"), ("/physical_device:GPU:1", "GPU")]
    logical = [("/device:CPU:0", "CPU"), ("/device:GPU:0", "GPU"), ("/device:GPU:1", "GPU")]
    details = [{"device_name": "NVIDIA A100", "compute_capability": (8, 0)}, {}]
    plan = plan_strategy("auto", ["/device:GPU:0", "/device:GPU:1"], ["/device:CPU:0"], platform="linux")
    report = build_report(physical, logical, details, [40960, None], (0, 1), plan, VERSIONS)
    gpu0, gpu1 = report["physical_devices"][1:]
    assert gpu0 == {"name": "/physical_device:GPU:0", "type": "GPU", "gpu_name": "NVIDIA A100",
                    "compute_capability": "8.0", "memory_mb": 40960}
    assert gpu1["gpu_name"] is None and gpu1["memory_mb"] is None
    assert report["strategy"]["kind"] == "mirrored" and report["strategy"]["all_reduce"] == "nccl"
    assert report["notes"] == [] and report["visible_gpus"] == [0, 1]
    text = format_report(report)
    assert "NVIDIA A100, compute capability 8.0, 40,960 MiB" in text
    assert "memory unknown (install nvidia-ml-py)" in text
    assert "strategy: MirroredStrategy on /gpu:0, /gpu:1 (2 replicas); all-reduce: NcclAllReduce" in text


def test_report_without_gpus_says_how_to_get_virtual_devices():
    plan = plan_strategy("auto", [], ["/device:CPU:0"])
    report = build_report([("/physical_device:CPU:0", "CPU")], [("/device:CPU:0", "CPU")], [], [], (), plan,
                          VERSIONS, ignored=("gpus ignored: this machine has no GPU",))
    assert report["notes"] == ["gpus ignored: this machine has no GPU", NO_GPU_HINT]
    assert "--virtual_cpus=2" in format_report(report)


def test_devices_json_on_this_machine():
    result = subprocess.run(
        [sys.executable, "-m", "gpupar", "devices", "--virtual_cpus=2", "--json"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert [d["name"] for d in report["logical_devices"] if d["type"] == "CPU"] == ["/device:CPU:0", "/device:CPU:1"]
    assert report["strategy"]["kind"] == "mirrored" and report["strategy"]["replicas"] == 2
    assert report["strategy"]["workers"] == 1  # one machine: no cluster's workers
    assert report["strategy"]["all_reduce"] == "reduction_to_one_device"
    assert report["tensorflow"].startswith("2.") and NO_GPU_HINT in report["notes"]
