"""The input-wait monitor: its verdict, and the warning training prints when input is slow."""

import re
import time

import numpy as np
import pytest
import tensorflow as tf

import gpupar
from gpupar.monitor import bottleneck
from gpupar.monitor.bottleneck import InputWait
from gpupar.config import Config
from conftest import make_idx_dir


@pytest.fixture(scope="module")
def idx_dir(tmp_path_factory):
    return make_idx_dir(tmp_path_factory.mktemp("data"), num_train=2048, num_test=256)


def test_verdict_needs_enough_steps_and_a_large_wait():
    wait = InputWait()
    wait.add(waited=3.0, busy=1.0, steps=2)
    assert wait.fraction == 0.75 and not wait.input_bound and "too few to judge" in wait.describe()
    wait.add(waited=0.0, busy=0.0, steps=2)
    assert wait.input_bound and wait.describe() == "input wait 75% of step time: input-bound"
    fast = InputWait(waited=0.25, busy=0.75, steps=10)
    assert not fast.input_bound and fast.describe() == "input wait 25% of step time: not input-bound"


def _hints(**preset):
    """What the MNIST preset's training data say may starve the step."""
    from gpupar.presets.mnist import MnistArrays
    from gpupar.presets.mnist_options import MnistOptions

    return MnistArrays(None, "train", "", MnistOptions(**preset)).input_bound_hints()


def test_causes_name_the_setting_and_its_fix():
    host = bottleneck.likely_causes(Config(num_parallel_calls=1, data_threads=1).input,
                                    _hints(augment=True, augment_on="host"), cpus=2)
    assert "use --augment_on=device" in host[0]
    assert "--num_parallel_calls=1 maps on fewer threads than the 2 CPU cores" in host[1]
    assert "--data_threads=1 gives tf.data fewer threads than the 2 CPU cores" in host[2]
    assert len(bottleneck.likely_causes(Config(num_parallel_calls=2, data_threads=2).input, cpus=2)) == 1
    assert bottleneck.likely_causes(Config().input, _hints(augment=True))[0].startswith(
        "run `gpupar diagnose` with the same flags")
    starved = bottleneck.likely_causes(Config().input, input_rate=50_000, step_rate=10_000)
    assert starved[0].startswith("the pipeline alone delivers 5x what the step takes") and "--data_threads" in starved[0]
    slow = bottleneck.likely_causes(Config().input, input_rate=5_000, step_rate=10_000)
    assert slow[0].startswith("the input pipeline alone is slower than the step (5,000 against 10,000 examples/s)")
    close = bottleneck.likely_causes(Config().input, input_rate=15_000, step_rate=10_000)
    assert close[0].startswith("the input pipeline alone is only 1.5x as fast as the step")


def _fit(idx_dir, **options):
    defaults = dict(data_dir=idx_dir, epochs=1, per_replica_batch_size=256, display_step=4, dropout=0.0,
                    strategy="one_device")
    return gpupar.fit_mnist(**{**defaults, **options})


@pytest.mark.slow
def test_host_augmentation_made_slow_is_reported_input_bound_in_the_first_epoch(tmp_path, capsys, slow_host_warp):
    # 16 steps: more than the prefetch buffer fills while the step traces and compiles.
    result = _fit(make_idx_dir(tmp_path / "data", num_train=4096), augment=True, augment_on="host")
    out = capsys.readouterr().out
    lines = out.splitlines()
    warned = next(i for i, line in enumerate(lines) if line.startswith("training is input-bound"))
    epoch_end = next(i for i, line in enumerate(lines) if line.startswith("Epoch:[0] loss:"))
    assert warned < epoch_end  # within the first epoch, at a progress line
    assert "augmentation runs on the host, one image at a time: use --augment_on=device" in lines[warned]
    assert re.search(r"Epoch:\[0\] loss: .*, input wait \d+%", out)
    assert result.records[0].input_wait_fraction > bottleneck.INPUT_BOUND
    assert out.count("training is input-bound") == 1


def test_training_without_augmentation_is_not_input_bound(idx_dir, capsys):
    result = _fit(idx_dir)
    out = capsys.readouterr().out
    assert "training is input-bound" not in out
    assert re.search(r"Epoch:\[0\] loss: .*, input wait \d+%", out)
    assert 0 <= result.records[0].input_wait_fraction < bottleneck.INPUT_BOUND


def test_device_augmentation_trains_and_is_not_input_bound(idx_dir, capsys):
    result = _fit(idx_dir, augment=True, epochs=3)
    out = capsys.readouterr().out
    assert "randomly shifted, rotated and zoomed on the device" in out
    assert "training is input-bound" not in out
    losses = [record.train_loss for record in result.records]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def _timed_call(iterator, batch_step, steps):
    from gpupar.training.inner_loop import InnerLoop

    run = InnerLoop(lambda batch, states: (batch_step(batch), states), (0.0, 0.0), parallel_iterations=1).call
    run(iterator, tf.constant(2), tf.constant(True))  # traces
    started = time.perf_counter()
    _, waited, busy = run(iterator, tf.constant(steps), tf.constant(False))
    waited, busy = float(waited), float(busy)
    return waited, busy, time.perf_counter() - started


def test_step_time_includes_work_that_the_sums_do_not_depend_on():
    weights = tf.Variable(tf.eye(400))

    def update_heavy(batch):  # like an optimizer update: state changes that no returned sum needs
        for _ in range(48):  # busy enough that a loaded machine's scheduling is not most of the wait
            weights.assign(tf.matmul(weights, weights) / tf.norm(weights))
        return tf.reduce_sum(batch), tf.constant(0.0)

    iterator = iter(tf.data.Dataset.from_tensors(tf.ones([4])).repeat())
    waited, busy, wall = _timed_call(iterator, update_heavy, 10)
    assert waited < 0.2 * (waited + busy)
    assert 0.7 * wall < waited + busy <= 1.01 * wall


def test_slow_input_shows_as_waiting():
    def slow(x):
        time.sleep(0.02)
        return x

    dataset = tf.data.Dataset.from_tensors(tf.ones([4])).repeat().map(
        lambda x: tf.numpy_function(slow, [x], tf.float32, stateful=False))
    waited, busy, wall = _timed_call(iter(dataset), lambda batch: (tf.reduce_sum(batch), tf.constant(0.0)), 10)
    assert waited > 0.8 * (waited + busy) and waited + busy <= 1.01 * wall


def test_the_steps_of_a_call_do_not_overlap():
    # Otherwise TensorFlow's while loop starts a step's get_next while the step before still runs,
    # and counts that running as waiting (two replicas on an in-memory pipeline read 50% "wait").
    from gpupar.training.inner_loop import InnerLoop, timed_loop_iterations

    run = InnerLoop(lambda batch, states: ((tf.reduce_sum(batch), tf.constant(0.0)), states), (0.0, 0.0),
                    parallel_iterations=timed_loop_iterations(on_gpus=False)).call
    iterator = iter(tf.data.Dataset.from_tensors(tf.ones([4])).repeat())
    graph = run.get_concrete_function(iterator, tf.constant(1), tf.constant(False)).graph
    loops = [op.get_attr("parallel_iterations") for op in graph.get_operations() if op.type.endswith("While")]
    assert loops == [1]
