"""GPU readiness: each decision of the GPU paths, as a pure function of fake devices, NVML and environments."""

import types

import numpy as np
import pytest
import tensorflow as tf

from gpupar.errors import GpuparError
from gpupar.runtime import nvml
from gpupar.runtime.cluster import Cluster
from gpupar.runtime.devices import plan_devices
from gpupar.runtime.launch import assign_gpus, visible_gpus
from gpupar.runtime.strategy import Plan, jit_compile_refusal, plan_strategy

GPUS = [f"/gpu:{i}" for i in range(8)]


def test_launch_gives_each_worker_its_own_gpus_and_none_to_the_chief_and_ps():
    sync = {"worker": ["a:1", "a:2"]}
    assert assign_gpus(sync, ["0", "1", "2", "3"]) == {"worker:0": ["0", "1"], "worker:1": ["2", "3"]}
    ps = {"chief": ["a:1"], "worker": ["a:2", "a:3"], "ps": ["a:4"]}
    assert assign_gpus(ps, ["0", "1", "2"], per_worker=1) == {"chief:0": [], "worker:0": ["0"], "worker:1": ["1"],
                                                             "ps:0": []}
    assert assign_gpus(sync, []) == {"worker:0": [], "worker:1": []}
    assert assign_gpus(sync, ["0", "1"], per_worker=0) == {"worker:0": [], "worker:1": []}
    with pytest.raises(GpuparError, match="2 workers but 1 GPU"):
        assign_gpus(sync, ["0"])
    with pytest.raises(GpuparError, match="--gpus_per_worker=2 for 2 workers needs 4 GPUs"):
        assign_gpus(sync, ["0", "1", "2"], per_worker=2)


def test_launch_reads_the_gpus_it_may_hand_out():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}, None) == ["2", "3"]
    assert visible_gpus({}, ["GPU 0: A100 (UUID: GPU-1)", "GPU 1: A100 (UUID: GPU-2)", "  MIG 1g.5gb"]) == ["0", "1"]
    assert visible_gpus({}, []) == []


def test_memory_growth_holds_with_virtual_cpus():
    plan = plan_devices(2, memory_growth=True, virtual_cpus=2)
    assert plan.environment == {"TF_FORCE_GPU_ALLOW_GROWTH": "true"} and plan.memory_growth
    assert plan_devices(0, memory_growth=True, virtual_cpus=2).environment == {}
    assert plan_devices(2, memory_growth=True, memory_limit_mb=1000).environment == {}  # a limit instead


def test_a_parameter_server_task_passes_the_device_settings_to_its_server_and_ps_stay_off_gpus():
    from gpupar.training.modes.parameter_server import _server_config, server_settings

    devices = plan_devices(2, memory_growth=True)
    assert server_settings("ps", devices)["device_count"] == {"GPU": 0}
    worker = server_settings("worker", devices)
    assert (worker["visible_device_list"], worker["allow_growth"]) == ("0,1", True)
    limited = server_settings("worker", plan_devices(2, gpus=[1], memory_limit_mb=4096))
    proto = _server_config(limited)
    assert proto.gpu_options.visible_device_list == "1" and not proto.gpu_options.allow_growth
    assert [list(d.memory_limit_mb) for d in proto.gpu_options.experimental.virtual_devices] == [[4096]]
    assert _server_config(server_settings("ps", devices)).device_count["GPU"] == 0


def test_hierarchical_copy_refuses_an_odd_gpu_count_and_auto_avoids_it():
    with pytest.raises(GpuparError, match="hierarchical_copy with 3 GPUs would drop one replica's gradients"):
        plan_strategy("mirrored", GPUS[:3], ["/cpu:0"], cross_device_ops="hierarchical_copy")
    assert plan_strategy("mirrored", GPUS[:4], ["/cpu:0"], cross_device_ops="hierarchical_copy").cross_device_ops == \
        "hierarchical_copy"
    assert plan_strategy("auto", GPUS[:3], ["/cpu:0"], platform="darwin").cross_device_ops == "reduction_to_one_device"
    assert plan_strategy("auto", GPUS[:4], ["/cpu:0"], platform="win32").cross_device_ops == "hierarchical_copy"


def test_parameter_servers_refuse_several_gpus_per_worker():
    cluster = Cluster({"chief": ("a:1",), "worker": ("a:2", "a:3"), "ps": ("a:4",)}, "chief", 0, "TF_CONFIG")
    with pytest.raises(GpuparError, match="parameter_server with 2 GPUs per task"):
        plan_strategy("parameter_server", GPUS[:2], ["/cpu:0"], cluster=cluster)
    assert plan_strategy("parameter_server", GPUS[:1], ["/cpu:0"], cluster=cluster).kind == "parameter_server"


def test_jit_compile_with_several_replicas_compiles_on_gpus_only():
    assert jit_compile_refusal(Plan("mirrored", tuple(GPUS[:2]), "nccl", None, "")) is None
    assert "between the 2 CPU replicas" in jit_compile_refusal(
        Plan("mirrored", ("/cpu:0", "/cpu:1"), "reduction_to_one_device", None, ""))
    assert jit_compile_refusal(Plan("one_device", ("/cpu:0",), None, None, "")) is None


def test_xla_batch_norm_falls_back_to_keras_where_xla_cannot_compile():
    import keras

    from gpupar.models.layers import XlaBatchNormalization, fall_back_from_xla

    model = keras.Sequential([keras.Input((4,)), XlaBatchNormalization(), keras.layers.Dense(2)])
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    reference = keras.layers.BatchNormalization()
    reference.build((None, 4))
    assert not fall_back_from_xla(model, None) and model.layers[0].use_xla
    assert fall_back_from_xla(model, "InternalError: libdevice not found at ./libdevice.10.bc")
    assert not model.layers[0].use_xla
    assert np.allclose(model.layers[0](x, training=True), reference(x, training=True), atol=1e-5)


def test_bus_ids_match_tensorflows_gpus_to_nvmls():
    assert nvml.normalise_bus_id("00000000:3B:00.0") == nvml.normalise_bus_id("0000:3b:00.0") == "0000:3b:00.0"
    cards = [nvml.NvmlGpu(0, "00000000:17:00.0", "GPU-a"), nvml.NvmlGpu(1, "00000000:3B:00.0", "GPU-b", mig=True)]
    assert nvml.match_by_bus_id(["0000:3b:00.0", "0000:17:00.0", None], cards) == [cards[1], cards[0], None]


def test_cuda_settings_say_which_nvml_gpu_each_tensorflow_gpu_is():
    cards = [nvml.NvmlGpu(i, f"0000:{17 + i:02x}:00.0", f"GPU-{i}") for i in range(4)]
    assert nvml.match_visible(4, cards, None, "PCI_BUS_ID") == cards
    assert nvml.match_visible(2, cards, "3,1", "PCI_BUS_ID") == [cards[3], cards[1]]  # remapped by CUDA_VISIBLE_DEVICES
    assert nvml.match_visible(2, cards, "GPU-2,MIG-5", None) == [cards[2], None]  # UUIDs in any order; MIG unknown
    assert nvml.match_visible(2, cards, "3,1", None) == [None, None]  # "fastest first": an index tells nothing


class _FakePynvml:
    """The part of pynvml that read_gpus uses: two 16 GiB cards, the second in MIG mode; `free`: each one's free GiB."""

    NVMLError = RuntimeError

    def __init__(self):
        self.free = [10, 2]

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, i):
        return types.SimpleNamespace(total=16 * 2**30, free=self.free[i] * 2**30)

    def nvmlDeviceGetMigMode(self, i):
        return (i, i)

    def nvmlDeviceGetPciInfo(self, i):
        return types.SimpleNamespace(busId=f"00000000:{0x17 + i:02X}:00.0".encode())

    def nvmlDeviceGetUUID(self, i):
        return f"GPU-{i}"

    def nvmlDeviceGetName(self, i):
        return b"NVIDIA A100"


def test_nvml_is_read_with_memory_and_mig_and_a_fraction_is_capped_at_what_is_free(monkeypatch):
    from gpupar.runtime import devices

    cards = nvml.read_gpus(_FakePynvml())
    assert [(g.index, g.bus_id, g.total_mb, g.free_mb, g.mig) for g in cards] == [
        (0, "00000000:17:00.0", 16384, 10240, False), (1, "00000000:18:00.0", 16384, 2048, True)]
    monkeypatch.setattr(devices, "installed_nvml", lambda: _FakePynvml())
    totals, free = devices.gpu_memory(1, {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert (totals, free) == ((16384,), (2048,))
    plan = plan_devices(1, memory_fraction=0.5, gpu_memory_mb=totals, gpu_free_mb=free)
    assert plan.memory_limits_mb == (2048,) and "capped at 2,048 MiB" in plan.ignored[0]


def test_the_loss_scale_is_checkpointed(tmp_path):
    import keras

    from gpupar.training.checkpoint import Checkpoints

    def scaled():
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
        optimizer.build([variable])
        return optimizer

    variable = keras.Variable(np.zeros(2, np.float32))
    first = scaled()
    first.dynamic_scale.assign(256.0)
    first.step_counter.assign(7)
    Checkpoints(str(tmp_path), {"model": keras.Sequential(), "optimizer": first.inner_optimizer},
                loss_scale_optimizer=first).save_epoch(1)
    again = scaled()
    assert float(again.dynamic_scale) == 32768.0
    Checkpoints(str(tmp_path), {"model": keras.Sequential(), "optimizer": again.inner_optimizer},
                loss_scale_optimizer=again).restore(True)
    assert (float(again.dynamic_scale), int(again.step_counter)) == (256.0, 7)


def test_the_sums_stay_on_the_replicas_until_the_call_ends():
    """No step waits for another's numbers on the host: the cross-replica sums come after the steps' loop."""
    from gpupar.training.inner_loop import InnerLoop

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    iterator = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(tf.ones([4])).repeat()))
    run = InnerLoop(lambda batch, states: ((tf.reduce_sum(batch), [tf.reduce_max(batch)]), states), (0.0, [0.0]),
                    strategy=strategy).call
    graph = run.get_concrete_function(iterator, tf.constant(1), tf.constant(False)).graph
    reductions = [op for op in graph.get_operations() if op.type == "AddN"]
    assert len(reductions) >= 2  # the two sums, reduced once, outside the loop
    (loss, (peak,)), _, _ = run(iterator, tf.constant(3), tf.constant(False))
    assert (float(loss), float(peak)) == (3 * 4.0, 3 * 2.0)  # 3 steps of 2 replicas of 2 ones each


def test_on_gpus_the_timed_steps_of_a_call_may_overlap_and_train_the_same():
    """The timed loop runs one step at a time only on CPUs; overlapping steps give the same update."""
    import keras

    from gpupar import keras_compat
    from gpupar.training.inner_loop import timed_loop_iterations
    from gpupar.training.steps.compiled import CompiledStep
    from gpupar.training.steps.step import train_function

    assert timed_loop_iterations(on_gpus=False) == 1 and timed_loop_iterations(on_gpus=True) == 10
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 6)).astype("float32"), rng.integers(0, 3, 96)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    results = {}
    for iterations in (1, 10):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
            optimizer = keras.optimizers.SGD(0.1)
            model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
            keras_compat.symbolic_build(model, (x[:2], y[:2]))
            optimizer.build(model.trainable_variables)
        step = CompiledStep(model, optimizer)
        train = train_function(step, strategy, parallel_iterations=iterations)
        with step.in_call():
            loop = train.get_concrete_function(iter(strategy.experimental_distribute_dataset(
                tf.data.Dataset.from_tensor_slices((x, y)).batch(16))), tf.constant(1), tf.constant(False)).graph
        assert [op.get_attr("parallel_iterations") for op in loop.get_operations()
                if op.type.endswith("While")] == [iterations]
        iterator = iter(strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(16)))
        with step.in_call():
            (loss_sum, rows), _, _ = train(iterator, tf.constant(6), tf.constant(False))
        results[iterations] = float(loss_sum) / float(rows), model.get_weights()
    (serial_loss, serial), (overlapped_loss, overlapped) = results[1], results[10]
    assert overlapped_loss == pytest.approx(serial_loss, rel=1e-6)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(serial, overlapped)) < 1e-6


def test_the_check_plan_runs_what_the_machine_can():
    from gpupar.commands.device_check import plan_checks

    here = plan_checks(0, nvml_installed=False, memory_setting=False)
    assert {name for name, why in here.items() if why is None} == {"all-reduce", "XLA batch norm", "mixed_float16 steps"}
    assert here["GPUs matched to NVML"] == "no GPU on this machine"
    gpu = plan_checks(4, nvml_installed=True, memory_setting=True)
    assert all(why is None for why in gpu.values())
    no_nvml = plan_checks(4, nvml_installed=False, memory_setting=False)
    assert "pip install 'gpupar[nvml]'" in no_nvml["GPUs matched to NVML"]
    assert "no memory setting given" in no_nvml["memory settings take effect"]
    assert "pip install 'gpupar[nvml]'" in plan_checks(4, nvml_installed=False, memory_setting=True)[
        "memory settings take effect"]  # NVML tells the memory in use
    unseen = plan_checks(0, nvml_installed=True, memory_setting=False, nvml_gpus=2)
    assert unseen["GPUs matched to NVML"] is None  # runs, to fail with the fix
    assert unseen["memory settings take effect"] == "TensorFlow sees no GPU"


def test_devices_check_on_this_machine_runs_the_cpu_checks():
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "gpupar", "devices", "--check", "--virtual_cpus=2", "--json"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-2000:]
    checks = {c["name"]: c for c in json.loads(done.stdout[done.stdout.index("["):])}
    assert [checks[n]["status"] for n in ("all-reduce", "XLA batch norm", "mixed_float16 steps")] == ["PASS"] * 3
    assert "sum 3" in checks["all-reduce"]["detail"]
    assert checks["GPUs matched to NVML"]["status"] == "NOT RUN" and checks["memory settings take effect"]["fix"]


def _tf_sees(bus_ids, monkeypatch):
    """TensorFlow's GPUs, as tf_bus_ids would list them."""
    from gpupar.commands import device_check

    monkeypatch.setattr(device_check, "tf_bus_ids", lambda: list(bus_ids))


def test_the_gpu_check_matches_tensorflows_gpus_to_nvmls_out_of_order_and_says_mig(monkeypatch):
    from gpupar.commands.device_check import FAIL, PASS, _match, judge_match

    cards = nvml.read_gpus(_FakePynvml())  # NVML 0 at bus 17, NVML 1 (MIG) at bus 18
    swapped = judge_match(["0000:18:00.0", "0000:17:00.0"], cards)
    assert swapped.status == PASS and swapped.detail == (
        "GPU:0 0000:18:00.0 -> NVML 1 NVIDIA A100 (MIG: NVML reports no utilisation); "
        "GPU:1 0000:17:00.0 -> NVML 0 NVIDIA A100")
    for unmatched in (["0000:17:00.0", "0000:65:00.0"], ["0000:17:00.0", None]):
        missing = judge_match(unmatched, cards)
        assert missing.status == FAIL and "GPU:1 " in missing.detail and missing.detail.endswith("-> none")
        assert "CUDA_VISIBLE_DEVICES" in missing.fix
    unseen = judge_match([], cards)
    assert unseen.status == FAIL and "NVML sees 2 GPU(s)" in unseen.detail and "tensorflow[and-cuda]" in unseen.fix

    _tf_sees(["0000:18:00.0"], monkeypatch)
    assert _match({"nvml": _FakePynvml()}).detail == "GPU:0 0000:18:00.0 -> NVML 1 NVIDIA A100 (MIG: NVML reports no " \
                                                     "utilisation)"


def test_the_memory_check_fails_where_a_gpu_lost_more_than_growth_or_its_limit_allows(monkeypatch):
    from gpupar.commands.device_check import FAIL, NOT_RUN, PASS, SLACK_MB, _memory, judge_memory, memory_taken_mb

    fake = _FakePynvml()
    before = nvml.read_gpus(fake)
    fake.free = [9, 1]
    taken = memory_taken_mb(["0000:18:00.0", "0000:17:00.0", "0000:65:00.0"], before, nvml.read_gpus(fake))
    assert taken == [1024, 1024, None]  # by bus id, in TensorFlow's order; None where NVML has no such GPU

    assert judge_memory([SLACK_MB, 0], None).status == PASS
    grabbed = judge_memory([SLACK_MB + 1, 0], None)  # memory growth: at most CUDA's context and a small op
    assert grabbed.status == FAIL and "TF_FORCE_GPU_ALLOW_GROWTH=true" in grabbed.fix
    assert grabbed.detail.startswith(f"GPU:0 {SLACK_MB + 1:,} MiB taken after a small op (at most {SLACK_MB:,})")
    assert judge_memory([4096 + SLACK_MB, None], (4096, 4096)).status == PASS
    over = judge_memory([100, 4097 + SLACK_MB], (4096, 4096))
    assert over.status == FAIL and "limit did not hold" in over.fix and "GPU:1 " in over.detail
    assert judge_memory([None, None], None).status == NOT_RUN

    _tf_sees(["0000:17:00.0"], monkeypatch)
    fake.free = [10, 2]
    context = {"nvml": fake, "before": nvml.read_gpus(fake), "devices": plan_devices(2, memory_growth=True)}
    fake.free = [4, 2]  # TensorFlow mapped 6 GiB of NVML 0 despite memory growth
    result = _memory(context)
    assert result.status == FAIL and result.detail.startswith("GPU:0 6,144 MiB taken")
    context["devices"] = plan_devices(2, memory_limit_mb=8192)
    assert _memory(context).status == PASS


def test_the_all_reduce_check_fails_on_a_wrong_sum():
    from gpupar.commands.device_check import FAIL, PASS, _all_reduce, judge_all_reduce

    plan = Plan("mirrored", tuple(GPUS[:3]), "nccl", None, "")
    assert judge_all_reduce(plan, 6.0).status == PASS  # 1 + 2 + 3
    wrong = judge_all_reduce(plan, 3.0)  # one replica's value dropped
    assert wrong.status == FAIL and wrong.detail.endswith("all-reduce nccl: sum 3, expected 6")
    assert "--cross_device_ops=reduction_to_one_device" in wrong.fix
    cpus = Plan("mirrored", ("/cpu:0", "/cpu:1"), "reduction_to_one_device", None, "")
    assert _all_reduce({"plan": cpus}).detail.endswith("sum 3")


def test_the_xla_check_fails_with_the_fix_for_its_device(monkeypatch):
    from gpupar.models import layers
    from gpupar.commands.device_check import FAIL, PASS, Check, _xla, judge_xla

    assert judge_xla("/gpu:0", None) == Check("XLA batch norm", PASS, "compiled on /gpu:0")
    on_gpu = judge_xla("/gpu:0", "InternalError: libdevice not found at ./libdevice.10.bc")
    assert on_gpu.status == FAIL and "pip install 'tensorflow[and-cuda]'" in on_gpu.fix and "falls back" in on_gpu.fix
    on_cpu = judge_xla("/cpu:0", "InternalError: no XLA")
    assert on_cpu.status == FAIL and "only on GPUs" in on_cpu.fix

    assert layers.xla_batch_norm_error("/cpu:0") is None

    def missing_libdevice(*args):
        raise tf.errors.InternalError(None, None, "libdevice not found at ./libdevice.10.bc\nsearched: /usr/local/cuda")

    monkeypatch.setattr(layers, "_normalise_batch", missing_libdevice)
    soft = tf.config.get_soft_device_placement()
    tf.config.set_soft_device_placement(True)  # the probe's inputs on the missing /gpu:0 land on the CPU
    try:
        assert layers.xla_batch_norm_error("/gpu:0") == "InternalError: libdevice not found at ./libdevice.10.bc"
        result = _xla({"plan": Plan("mirrored", tuple(GPUS[:2]), "nccl", None, "")})
    finally:
        tf.config.set_soft_device_placement(soft)  # another test in this process may have turned it off
    assert result.status == FAIL and result.detail.startswith("InternalError: libdevice") and "ptxas" in result.fix


def test_the_xla_fallback_reaches_nested_layers_and_leaves_other_models_alone():
    import keras

    from gpupar.models.layers import XlaBatchNormalization, fall_back_from_xla

    inner = keras.Sequential([keras.Input((4,)), XlaBatchNormalization()])
    outer = keras.Sequential([keras.Input((4,)), inner, keras.layers.Dense(2)])
    assert fall_back_from_xla(outer, "InternalError: libdevice not found") and not inner.layers[0].use_xla
    plain = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization()])
    assert not fall_back_from_xla(plain, "InternalError: libdevice not found")


def test_the_mixed_float16_check_needs_a_falling_loss_and_a_scale_that_holds():
    from gpupar.commands.device_check import FAIL, PASS, judge_mixed_steps

    assert judge_mixed_steps("/gpu:0", [2.3, 1.1, 0.4], 32768.0).status == PASS
    for losses, scale in (([2.3, 2.4], 32768.0), ([2.3, float("nan"), 0.4], 32768.0), ([2.3, 0.4], 0.5)):
        failed = judge_mixed_steps("/gpu:0", losses, scale)
        assert failed.status == FAIL and "precision=float32" in failed.fix, (losses, scale)
    assert judge_mixed_steps("/gpu:0", [2.3, 0.4], 0.5).detail == "on /gpu:0: loss 2.300 -> 0.400, loss scale 0.5"


def test_the_checks_print_pass_fail_and_not_run_with_the_fix_and_as_json():
    import json

    from gpupar.commands.device_check import FAIL, NOT_RUN, PASS, Check, _guarded, format_checks, to_json

    results = [Check("all-reduce", PASS, "sum 3"), Check("XLA batch norm", FAIL, "InternalError: x", "install it"),
               Check("GPUs matched to NVML", NOT_RUN, "", "no GPU on this machine")]
    assert format_checks(results).splitlines() == [
        "PASS     all-reduce: sum 3", "FAIL     XLA batch norm: InternalError: x", "         fix: install it",
        "NOT RUN  GPUs matched to NVML", "         why: no GPU on this machine"]
    assert json.loads(to_json(results)) == [
        {"name": "all-reduce", "status": "PASS", "detail": "sum 3", "fix": ""},
        {"name": "XLA batch norm", "status": "FAIL", "detail": "InternalError: x", "fix": "install it"},
        {"name": "GPUs matched to NVML", "status": "NOT RUN", "detail": "", "fix": "no GPU on this machine"}]

    def crashes(context):
        raise RuntimeError("failed call to cuInit: CUDA_ERROR_NO_DEVICE\nmore")

    crashed = _guarded("all-reduce", crashes, {})
    assert crashed.status == FAIL and "gpupar devices" in crashed.fix
    assert crashed.detail.startswith("RuntimeError: failed call to cuInit: CUDA_ERROR_NO_DEVICE (")  # its first line
    assert crashed.detail.endswith(" s)")


def test_the_checks_read_nvml_before_tensorflow_and_fail_where_it_sees_none_of_nvmls_gpus(monkeypatch):
    from gpupar import Config
    from gpupar.commands import device_check
    from gpupar.runtime import devices

    order = []

    def read_gpus(module):
        order.append("NVML")
        return nvml.read_gpus(module)

    def configure_devices(config):
        order.append("TensorFlow")
        return plan_devices(0)

    monkeypatch.setattr(device_check, "installed_nvml", lambda: _FakePynvml())
    monkeypatch.setattr(device_check, "read_gpus", read_gpus)
    monkeypatch.setattr(devices, "configure_devices", configure_devices)
    for name in ("all-reduce", "XLA batch norm", "mixed_float16 steps"):
        monkeypatch.setitem(device_check._RUN, name, lambda context, name=name: device_check.Check(name, "PASS"))
    results = {c.name: c for c in device_check.run_checks(Config())}
    assert order[:2] == ["NVML", "TensorFlow"]  # the memory check's baseline comes before TensorFlow starts
    match = results["GPUs matched to NVML"]
    assert match.status == "FAIL" and "NVML sees 2 GPU(s)" in match.detail
    assert results["memory settings take effect"].fix == "TensorFlow sees no GPU"


def test_tensorflows_bus_ids_come_from_devices_made_with_the_runtimes_settings(monkeypatch):
    from tensorflow.core.framework import device_attributes_pb2
    from tensorflow.python.client import device_lib
    from tensorflow.python.eager import context

    given = []

    def list_local_devices(session_config=None):
        given.append(session_config)
        desc = "device: {}, name: NVIDIA A100, pci bus id: {}, compute capability: 8.0"
        return [device_attributes_pb2.DeviceAttributes(name="/device:CPU:0", device_type="CPU"),
                device_attributes_pb2.DeviceAttributes(name="/device:GPU:0", device_type="GPU",
                                                       physical_device_desc=desc.format(0, "0000:3b:00.0")),
                device_attributes_pb2.DeviceAttributes(name="/device:GPU:1", device_type="GPU",
                                                       physical_device_desc="device: 1, name: a GPU")]

    monkeypatch.setattr(device_lib, "list_local_devices", list_local_devices)
    assert nvml.tf_bus_ids() == ["0000:3b:00.0", None]
    # the default config would make every GPU anew with default memory settings, the hidden ones included
    assert given == [context.context().config] and given[0].device_count["CPU"] == 4
