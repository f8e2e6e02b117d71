"""Strategy decisions from fake device lists, and each kind built and stepped on virtual CPUs."""

import numpy as np
import pytest
import tensorflow as tf

from gpupar.errors import GpuparError
from gpupar.runtime.strategy import build_strategy, make_strategy, plan_strategy, short_name

GPU = lambda n: [f"/job:localhost/replica:0/task:0/device:GPU:{i}" for i in range(n)]  # noqa: E731
CPU = lambda n: [f"/device:CPU:{i}" for i in range(n)]  # noqa: E731


def test_short_names():
    assert short_name("/job:localhost/replica:0/task:0/device:GPU:1") == "/gpu:1"
    assert short_name("/cpu:0") == "/cpu:0"


@pytest.mark.parametrize(
    "gpus, cpus, kind, devices, all_reduce",
    [
        (0, 1, "one_device", ("/cpu:0",), None),
        (0, 3, "mirrored", ("/cpu:0", "/cpu:1", "/cpu:2"), "reduction_to_one_device"),
        (1, 1, "one_device", ("/gpu:0",), None),
        (4, 1, "mirrored", ("/gpu:0", "/gpu:1", "/gpu:2", "/gpu:3"), "nccl"),
    ],
)
def test_auto_choice(gpus, cpus, kind, devices, all_reduce):
    plan = plan_strategy("auto", GPU(gpus), CPU(cpus), platform="linux")
    assert (plan.kind, plan.devices, plan.cross_device_ops) == (kind, devices, all_reduce)


def test_nccl_falls_back_where_tensorflow_has_none():
    assert plan_strategy("auto", GPU(2), CPU(1), platform="win32").cross_device_ops == "hierarchical_copy"


def test_explicit_all_reduce_and_devices():
    plan = plan_strategy("mirrored", GPU(4), CPU(1), devices=["/gpu:1", "/gpu:3"], cross_device_ops="hierarchical_copy")
    assert plan.devices == ("/gpu:1", "/gpu:3") and plan.cross_device_ops == "hierarchical_copy"


def test_central_storage_keeps_variables_on_the_cpu():
    plan = plan_strategy("central_storage", GPU(2), CPU(1))
    assert plan.devices == ("/gpu:0", "/gpu:1") and plan.parameter_device == "/cpu:0"
    assert "CentralStorageStrategy" in plan.describe()


def test_one_device_takes_the_first_device():
    assert plan_strategy("one_device", GPU(2), CPU(1)).devices == ("/gpu:0",)


def test_describe_names_strategy_devices_replicas_and_all_reduce():
    line = plan_strategy("auto", GPU(2), CPU(1), platform="linux").describe()
    assert line.startswith("strategy: MirroredStrategy on /gpu:0, /gpu:1 (2 replicas); all-reduce: NcclAllReduce")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="towers"), "strategy='towers' is unknown; choose one of: auto, one_device, mirrored, central_storage"),
        (dict(kind="mirrored"), "strategy=mirrored needs at least 2 devices"),
        (dict(kind="mirrored", cross_device_ops="nccl", cpus=2), "cross_device_ops=nccl all-reduces between GPUs"),
        (dict(kind="auto", devices=["/gpu:3"]), "device /gpu:3 does not exist here; available: /cpu:0"),
        (dict(kind="one_device", devices=["/cpu:0", "/cpu:1"], cpus=2), "runs on one device, but 2 were given"),
        (dict(kind="auto", cross_device_ops="ring"), "cross_device_ops='ring' is unknown"),
    ],
)
def test_bad_requests_are_clear_errors(kwargs, message):
    cpus = kwargs.pop("cpus", 1)
    with pytest.raises(GpuparError) as e:
        plan_strategy(gpus=[], cpus=CPU(cpus), **kwargs)
    assert message in str(e.value)


def _one_sgd_step(strategy):
    """Runs one step of y = w.x under the strategy; returns the new w (summed gradient applied)."""
    with strategy.scope():
        w = tf.Variable(1.0, aggregation=tf.VariableAggregation.MEAN)
    x = tf.data.Dataset.from_tensors(tf.ones([4])).repeat()
    it = iter(strategy.experimental_distribute_dataset(x))

    @tf.function
    def step():
        def replica(batch):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(w * batch, global_batch_size=4)
            grad = tape.gradient(loss, w)
            grad = tf.distribute.get_replica_context().all_reduce("sum", grad)
            w.assign_sub(0.5 * grad)

        strategy.run(replica, args=(next(it),))

    step()
    return float(w.numpy())


@pytest.mark.parametrize(
    "kind, devices, expected_class, replicas",
    [
        ("one_device", None, tf.distribute.OneDeviceStrategy, 1),
        ("mirrored", ["/cpu:0", "/cpu:1"], tf.distribute.MirroredStrategy, 2),
        ("central_storage", ["/cpu:0", "/cpu:1"], tf.distribute.experimental.CentralStorageStrategy, 2),
    ],
)
def test_each_kind_builds_and_steps(kind, devices, expected_class, replicas, capsys):
    strategy = make_strategy(kind, devices=devices)
    assert isinstance(strategy, expected_class) and strategy.num_replicas_in_sync == replicas
    assert capsys.readouterr().out.startswith("strategy: ")
    # d(mean of w*1)/dw = 1 whatever the replica count, so w goes from 1.0 to 0.5.
    np.testing.assert_allclose(_one_sgd_step(strategy), 0.5, rtol=1e-6)


def test_build_strategy_uses_the_planned_all_reduce():
    plan = plan_strategy("mirrored", [], CPU(2), cross_device_ops="reduction_to_one_device")
    strategy = build_strategy(plan)
    assert isinstance(strategy.extended._cross_device_ops, tf.distribute.ReductionToOneDevice)
