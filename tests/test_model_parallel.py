"""strategy=model_parallel: stage plans, placement read from the placed graph, numerics, checkpoints."""

import functools
import json
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import gpupar
from gpupar import keras_compat
from gpupar.errors import GpuparError
from gpupar.models import convnet, lstm
from gpupar.models.convnet import build_convnet
from gpupar.models.lstm import build_lstm
from gpupar.models.staged import build_on_stages, chain_layers
from gpupar.runtime.stages import plan_stages, stage_of_layers
from gpupar.presets.mnist import LOSS
from gpupar.training.steps.pipelined import PipelineStep
from gpupar.training.steps.step import train_function

CPUS = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
GPUS = [f"/gpu:{i}" for i in range(8)]
# Splitting and micro-batching only reorder float32 sums: gradients agree to ~1e-7 relative.
# A real difference in the computation (batch-norm statistics of a part of the batch) is ~1e-2.
RTOL = 1e-4


# --- the plan, from fake device lists ---------------------------------------------------------

def test_consecutive_stages_on_consecutive_devices():
    plan = plan_stages(GPUS[:3], 3)
    assert plan.replicas == (("/gpu:0", "/gpu:1", "/gpu:2"),) and plan.unused == ()
    assert plan.describe().startswith("strategy: model parallel, 1 replica x 3 stages (replica 0: /gpu:0 -> /gpu:1")


def test_spare_devices_become_data_parallel_replicas():
    plan = plan_stages(GPUS[:4], 2)
    assert plan.replicas == (("/gpu:0", "/gpu:1"), ("/gpu:2", "/gpu:3"))
    assert plan.variable_devices == ("/gpu:0", "/gpu:1") and plan.num_replicas == 2


def test_devices_that_do_not_make_a_whole_replica_are_left_out():
    plan = plan_stages(GPUS[:5], 2)
    assert plan.num_replicas == 2 and plan.unused == ("/gpu:4",) and "unused: /gpu:4" in plan.describe()


def test_fewer_devices_than_stages_is_an_error():
    with pytest.raises(GpuparError, match=r"3 stages on its own device, but only 2 device\(s\).*virtual_cpus=3"):
        plan_stages(CPUS[:2], 3)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(microbatches=4), "microbatches=4 pipelines the stages of strategy=model_parallel"),
        (dict(strategy="model_parallel", per_replica_batch_size=30, microbatches=4),
         "per_replica_batch_size=30 does not split"),
        (dict(strategy="model_parallel", nan_policy="skip"), "nan_policy=skip drops a step on every replica at once"),
        (dict(strategy="model_parallel", sync_batch_norm=True), "normalises each micro-batch"),
        (dict(model="resnet"), "model='resnet' is unknown; choose one of: convnet, lstm"),
        (dict(lstm_layers=0), "lstm_layers=0: must be a whole number > 0"),
    ],
)
def test_bad_model_parallel_options_are_refused(options, message):
    from gpupar.presets.mnist import refuse_for_mode
    from gpupar.presets.mnist_options import mnist_options
    from gpupar.training import modes

    with pytest.raises(GpuparError, match=re.escape(message)):
        config, preset = mnist_options(options=options)
        refuse_for_mode(preset, modes.checked(config))


def test_model_parallel_is_not_a_tf_distribute_strategy():
    with pytest.raises(GpuparError, match="strategy=model_parallel is gpupar's own mode, not a tf.distribute strategy"):
        gpupar.plan_strategy("model_parallel", [], CPUS)


def test_where_the_presets_split():
    names = [layer.name for layer in build_convnet(0.0).layers]
    assert stage_of_layers(names, convnet.STAGE_ENDS) == [0] * 8 + [1] * 6  # convolutions | flatten, dense head
    names = [layer.name for layer in build_lstm(3, 8).layers]
    assert stage_of_layers(names, lstm.stage_ends(3)) == [0, 0, 1, 2, 2]  # reshape + LSTM | LSTM | LSTM + dense


def test_stages_end_where_named_by_name_or_index():
    names = ["embed", "conv_out", "pool", "dense_1", "logits"]
    assert stage_of_layers(names, ["conv_out", "dense_1"]) == [0, 0, 1, 1, 2]
    assert stage_of_layers(names, [1, 3]) == [0, 0, 1, 1, 2]
    assert stage_of_layers(names, []) == [0] * 5


@pytest.mark.parametrize("ends, message", [
    (["conv"], "the model has no layer 'conv'; its layers are 0: embed, 1: conv_out"),
    ([7], "layer 7 does not exist"),
    (["dense_1", "conv_out"], "in order and before the last layer"),
    (["logits"], "in order and before the last layer"),
])
def test_stages_that_do_not_fit_the_layers_are_refused(ends, message):
    with pytest.raises(GpuparError, match=re.escape(message)):
        stage_of_layers(["embed", "conv_out", "pool", "dense_1", "logits"], ends)


def _chain():
    x = keras.Input((6,))
    return keras.Model(x, keras.layers.Dense(2, name="out")(keras.layers.Dense(4, name="hidden")(x)))


def _residual():
    x = keras.Input((6,))
    h = keras.layers.Dense(6, name="hidden")(x)
    return keras.Model(x, keras.layers.Dense(2)(keras.layers.Add()([x, h])))


def _two_inputs():
    a, b = keras.Input((3,)), keras.Input((3,))
    return keras.Model([a, b], keras.layers.Dense(2)(keras.layers.Concatenate()([a, b])))


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_a_functional_chain_is_split_like_a_sequential_model():
    assert [layer.name for layer in chain_layers(_chain())] == ["hidden", "out"]


@pytest.mark.parametrize("build", [_residual, _two_inputs, _Subclassed], ids=["residual", "two-inputs", "subclassed"])
def test_a_model_that_is_not_a_chain_is_refused(build):
    with pytest.raises(GpuparError, match="stages split a chain of layers"):
        chain_layers(build())


# --- placement, read from the partitioned graphs TensorFlow ran --------------------------------

def _placed_nodes(function, *args):
    """(name, op, device) of every node of the graphs TensorFlow placed and ran for this call."""
    context.enable_run_metadata()
    try:
        function(*args)
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    return [(n.name, n.op, n.device) for f in metadata.function_graphs for g in f.partition_graphs for n in g.node]


def _batches(batch, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.uniform(size=(batch, 28, 28, 1)).astype(np.float32)
    labels = rng.integers(0, 10, size=batch).astype(np.int32)
    return tf.data.Dataset.from_tensors((images, labels)).repeat()


STAGE_SCOPE = re.compile(r"(forward|accumulate)_r(\d+)_s(\d+)")
# Transfers (both ends carry the name of the op whose output they move) and constants, which
# grappler's constant folding and control-edge grouping put beside the op they feed a signal from.
NOT_COMPUTE = ("_Send", "_Recv", "_HostSend", "_HostRecv", "Const")
# Loop frames and control-edge groups the graph partitioner adds to carry control edges across devices.
PARTITIONER_PREFIXES = ("_cloop", "GroupCrossDeviceControlEdges")


def _users_model():
    """A user's Sequential model of three stages, none of them gpupar's layers."""
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
                             keras.layers.MaxPooling2D(name="pool"), keras.layers.Flatten(name="flat"),
                             keras.layers.Dense(16, activation="relu", name="hidden"),
                             keras.layers.Dense(10, name="logits")])


USERS_ENDS = ("pool", "hidden")


def _pipeline(build, ends, plan, microbatches):
    """(the PipelineStep of build()'s model split at ends over plan, with a built Adam; its model)."""
    model = build_on_stages(build, ends, plan.variable_devices)
    stage_of = stage_of_layers([layer.name for layer in chain_layers(model)], ends)
    images, labels = next(iter(_batches(2)))
    optimizer = keras.optimizers.Adam()
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
    keras_compat.symbolic_build(model, (images, labels))
    optimizer.build(model.trainable_variables)
    return PipelineStep(model, stage_of, plan, optimizer, microbatches), model


@pytest.mark.parametrize(
    "build, ends, devices, microbatches",
    [(lambda: build_lstm(3, 8), lstm.stage_ends(3), CPUS[:3], 2),  # 1 replica x 3 stages
     (lambda: build_convnet(0.0), convnet.STAGE_ENDS, CPUS, 2),    # 2 replicas x 2 stages
     (_users_model, USERS_ENDS, CPUS[:3], 4)],                     # a user's model, 1 replica x 3 stages
    ids=["lstm-3-stages", "convnet-2x2", "users-model-3-stages"],
)
def test_every_op_of_stage_k_runs_on_device_k(build, ends, devices, microbatches):
    stages = len(ends) + 1
    plan = plan_stages(devices, stages)
    pipeline, model = _pipeline(build, ends, plan, microbatches)
    for k, layers in enumerate(pipeline.stages):
        assert {v.value.device for layer in layers for v in layer.weights} == {
            f"/job:localhost/replica:0/task:0/device:CPU:{plan.variable_devices[k][-1]}"}
    train = train_function(pipeline, None)
    with pipeline.in_call():
        nodes = _placed_nodes(train, iter(_batches(16)), tf.constant(1))
    seen, wrong = set(), []
    for name, op, device in nodes:
        match = STAGE_SCOPE.search(name)
        if match is None or op in NOT_COMPUTE or name.startswith(PARTITIONER_PREFIXES):
            continue
        kind, replica, stage = match.group(1), int(match.group(2)), int(match.group(3))
        kind = "backward" if "gradient_tape" in name else kind  # gradient ops are named after their op
        seen.add((kind, replica, stage))
        # Reading or assigning a variable runs where the variable is: replica 0's stage device.
        expected = plan.variable_devices[stage] if op.endswith("VariableOp") else plan.replicas[replica][stage]
        if not device.endswith("CPU:" + expected[-1]):
            wrong.append((name, op, device))
    assert not wrong, [w[:2] for w in wrong]
    every = {(kind, r, k) for kind in ("forward", "backward") for r in range(plan.num_replicas) for k in range(stages)}
    assert every <= seen  # each stage of each replica ran its forward and its backward ops
    assert {k for kind, _, k in seen if kind == "accumulate"} == set(range(stages))  # grappler may merge sums
    assert sum(1 for _, op, _ in nodes if op == "_Send") >= 2 * (stages - 1)  # activations and gradients cross


# --- numerics: split == unsplit, micro-batches == one batch ------------------------------------

def _max_relative_difference(a, b):
    return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12)) for x, y in zip(a, b))


def _one_device_gradients(model, images, labels, global_batch, pieces=1):
    """Loss and gradients of the unsplit model on one device, one tape, the batch in `pieces` calls."""

    @tf.function
    def run():
        with tf.GradientTape() as tape:
            loss = 0.0
            for x, y in zip(tf.split(images, pieces), tf.split(labels, pieces)):
                logits = model(x, training=True)
                per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
                loss += tf.reduce_sum(per_example) / global_batch
            if model.losses:
                loss += tf.add_n(model.losses)
        return loss, tape.gradient(loss, model.trainable_variables)

    loss, grads = run()
    return float(loss), [g.numpy() for g in grads]


def _pipelined_gradients(pipeline, images, labels):
    states = [tf.identity(v.value) for v in pipeline.state_variables]
    with pipeline.in_call():
        loss, grads, _ = tf.function(lambda: pipeline.gradients((images, labels), states))()
    return float(loss), [g.numpy() for g in grads]


def _pair(build, ends, plan, microbatches):
    """The PipelineStep of build()'s model split over plan's devices, and the same model unsplit, with the same weights."""
    pipeline, split = _pipeline(build, ends, plan, microbatches)
    whole = build()
    whole.set_weights(split.get_weights())
    return pipeline, whole


def _lstm(layers):
    return lambda: build_lstm(layers, 16, seed=1)


def _convnet():
    return build_convnet(0.0, seed=1)


@pytest.fixture(scope="module")
def batch():
    images, labels = next(iter(_batches(16, seed=3)))
    return tf.constant(images), tf.constant(labels)


@pytest.mark.parametrize(
    "build, ends, devices",
    [(_lstm(3), lstm.stage_ends(3), CPUS[:3]), (_lstm(2), lstm.stage_ends(2), CPUS), (_convnet, convnet.STAGE_ENDS, CPUS[:2]),
     (_users_model, USERS_ENDS, CPUS[:3])],
    ids=["lstm-3-stages", "lstm-2-replicas-x-2-stages", "convnet-2-stages", "users-model-3-stages"],
)
def test_split_model_computes_the_loss_and_gradients_of_the_unsplit_one(batch, build, ends, devices):
    images, labels = batch
    plan = plan_stages(devices, len(ends) + 1)
    for microbatches in (1, 4):  # no batch norm but in the ConvNet: micro-batches change nothing
        if build is _convnet and microbatches > 1:
            continue
        pipeline, whole = _pair(build, ends, plan, microbatches)
        expected_loss, expected = _one_device_gradients(whole, images, labels, 16)
        loss, grads = _pipelined_gradients(pipeline, images, labels)
        assert loss == pytest.approx(expected_loss, rel=1e-5)
        assert _max_relative_difference(grads, expected) < RTOL
    assert max(float(np.max(np.abs(g))) for g in expected) > 1e-3  # a real, non-zero gradient


def test_convnet_micro_batches_normalise_by_their_own_statistics(batch):
    """Batch norm sees each micro-batch alone (as in GPipe): M=4 is the unsplit model on 4 quarters."""
    images, labels = batch
    plan = plan_stages(CPUS[:2], 2)
    pipeline, whole = _pair(_convnet, convnet.STAGE_ENDS, plan, 4)
    loss, grads = _pipelined_gradients(pipeline, images, labels)
    quarters_loss, quarters = _one_device_gradients(whole, images, labels, 16, pieces=4)
    assert loss == pytest.approx(quarters_loss, rel=1e-5)
    assert _max_relative_difference(grads, quarters) < RTOL
    _, whole_batch = _one_device_gradients(whole, images, labels, 16)
    assert _max_relative_difference(grads, whole_batch) > 100 * RTOL  # and so not the whole batch's


# --- training runs: split and unsplit continue each other's checkpoints -------------------------

def _fit(data_dir, **options):
    defaults = dict(data_dir=data_dir, model="lstm", lstm_layers=3, lstm_units=16, per_replica_batch_size=32, epochs=2,
                    steps_per_epoch=3, display_step=100, seed=0)
    return gpupar.fit_mnist(**{**defaults, **options})


@pytest.mark.slow
def test_checkpoints_move_between_split_and_unsplit_models(shared_idx_dir, tmp_path):
    """Split runs (with micro-batches) and one-device runs resume each other and end with the same weights."""
    fit = functools.partial(_fit, shared_idx_dir, lstm_layers=2)  # two stages: as telling as three, faster to trace
    unsplit = fit(strategy="one_device", model_dir=str(tmp_path / "unsplit"))
    split = fit(strategy="model_parallel", virtual_cpus=2, microbatches=4, epochs=1, model_dir=str(tmp_path / "split"))
    assert "model parallel, 1 replica x 2 stages" in split.strategy_description
    split_then_unsplit = fit(strategy="one_device", resume=str(tmp_path / "split" / "ckpt-1"))
    unsplit_then_split = fit(strategy="model_parallel", virtual_cpus=2, microbatches=2,
                             resume=str(tmp_path / "unsplit" / "ckpt-1"))
    assert split_then_unsplit.start_epoch == unsplit_then_split.start_epoch == 1
    final = unsplit.model.get_weights()
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(final, split.model.get_weights()))
    assert moved > 1e-3  # the second epoch really changed the weights
    for result in (split_then_unsplit, unsplit_then_split):
        assert max(float(np.max(np.abs(a - b))) for a, b in zip(final, result.model.get_weights())) < 1e-5
    assert split_then_unsplit.test_accuracy == unsplit_then_split.test_accuracy == unsplit.test_accuracy


@pytest.mark.slow
def test_pipeline_benchmark_reports_m1_and_m4_on_one_and_several_devices(shared_idx_dir):
    from benchmarks import pipeline as bench_pipeline

    report = bench_pipeline.benchmark(shared_idx_dir, batch_size=16, steps=1, repeats=1, lstm_units=8,
                                      names=("lstm-2",), probe_seconds=0.01)
    rows = {(r["placement"], r["microbatches"]): r for r in report["configurations"]}
    assert set(rows) == {(p, m) for p in ("1 device", "2 devices") for m in (1, 4)}
    assert rows["2 devices", 4]["devices"] == ["/cpu:0", "/cpu:1"] and rows["1 device", 4]["devices"] == ["/cpu:0"]
    assert all(r["median"] > 0 and len(r["images_per_second"]) == 1 for r in rows.values())
    assert rows["2 devices", 4]["ideal_speedup_over_m1"] == pytest.approx(1.6)  # 2 * 4 / (4 + 2 - 1)
    assert rows["1 device", 4]["ideal_speedup_over_m1"] == 1.0 and rows["2 devices", 1]["speedup_over_m1"] == 1.0
    probe = {(r["placement"], r["microbatches"]): r for r in report["schedule_probe"]}
    assert set(probe) == {(p, m) for p in ("1 device", "3 devices") for m in (1, 4)}
    assert probe["3 devices", 4]["gpipe_overlap"] == pytest.approx(0.015)  # (4 + 2) / 4 x 0.01 s
    # Not a timing target: the critical path of the waits bounds any schedule, so this fails only
    # when the waits did not run in the step (pruned or hoisted out of it).
    assert probe["3 devices", 4]["critical_path"] == pytest.approx(0.0075)  # 3 / 4 x 0.01 s
    assert all(r["step_seconds"] >= r["critical_path"] for r in probe.values())
    assert "| lstm-2 | 2 devices | 4 |" in bench_pipeline.table(report)
    json.dumps(report)  # what the script writes


def test_the_lstm_also_trains_data_parallel(shared_idx_dir):
    result = _fit(shared_idx_dir, strategy="mirrored", virtual_cpus=2, per_replica_batch_size=16, epochs=1)
    keras.utils.set_random_seed(0)
    initial = build_lstm(3, 16, seed=0).get_weights()
    assert result.replicas == 2 and "MirroredStrategy" in result.strategy_description
    assert all(np.isfinite(w).all() for w in result.model.get_weights())
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(result.model.get_weights(), initial)) > 1e-3


# --- gpupar.fit with a user's model in stages ----------------------------------------------------

def _users_dense():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh", name="a",
                                                                   kernel_regularizer=keras.regularizers.L2(0.01)),
                             keras.layers.Dense(8, activation="tanh", name="b"), keras.layers.Dense(4, name="c")])


def _users_fit(**options):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 6)).astype("float32")
    y = np.argmax(x[:, :4], axis=1).astype("int32")
    weights = np.where(y == 0, 3.0, 0.5).astype("float32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean_with_sample_weight")
    settings = dict(validation_data=(x[:50], y[:50]), loss=loss, metrics=["accuracy"],
                    optimizer=lambda: keras.optimizers.SGD(0.1), batch_size=32, epochs=1, steps_per_epoch=4, save=False)
    return gpupar.fit(_users_dense, x, y, sample_weight=weights, **{**settings, **options})


def test_fit_trains_a_users_model_in_stages_to_the_one_device_weights():
    one_device = _users_fit(strategy="one_device")
    initial = _users_dense().get_weights()
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(one_device.model.get_weights(), initial)) > 1e-2
    for stages, microbatches in ((("a", "b"), 1), ((0, 1), 4)):  # by name or index; M=4 gives the M=1 update
        split = _users_fit(strategy="model_parallel", virtual_cpus=3, stages=stages, microbatches=microbatches)
        assert "1 replica x 3 stages" in split.strategy_description
        assert max(float(np.max(np.abs(a - b))) for a, b in zip(split.model.get_weights(),
                                                                 one_device.model.get_weights())) < 1e-5
        assert split.logs == pytest.approx(one_device.logs, rel=1e-5)  # loss, accuracy, val_loss, val_accuracy


@pytest.mark.parametrize("options, message", [
    (dict(), "strategy=model_parallel needs stages: the layers after which a new stage starts"),
    (dict(stages=("a", "d")), "stages: the model has no layer 'd'; its layers are 0: a, 1: b, 2: c"),
    (dict(stages=("a",), microbatches=3), "batch_size=32 does not split into microbatches=3"),
])
def test_bad_stages_for_a_users_model_are_one_line_before_any_step(options, message):
    with pytest.raises(GpuparError, match=re.escape(message)) as e:
        _users_fit(strategy="model_parallel", virtual_cpus=3, save=True, **options)
    assert "\n" not in str(e.value) and not os.path.exists("runs")  # nothing written


def test_a_users_model_that_is_not_a_chain_or_a_dataset_fn_is_refused_with_stages():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)).astype("float32"), rng.integers(0, 2, 64)
    with pytest.raises(GpuparError, match="stages split a chain of layers"):
        gpupar.fit(_residual, x, y, loss="sparse_categorical_crossentropy", strategy="model_parallel",
                   stages=("hidden",), virtual_cpus=2, batch_size=8, epochs=1, save=False)
    with pytest.raises(GpuparError, match="x is a dataset_fn, which gives per-replica batches"):
        gpupar.fit(_chain, lambda context: tf.data.Dataset.from_tensor_slices((x, y)).batch(8), strategy="model_parallel",
                   stages=("hidden",), virtual_cpus=2, epochs=1, steps_per_epoch=2, save=False)
    with pytest.raises(GpuparError, match=r"stages=hidden splits a model for strategy=model_parallel"):
        gpupar.fit(_chain, x, y, stages=("hidden",), batch_size=8, epochs=1, save=False)


def _small_chain():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh", name="hidden"),
                              keras.layers.Dense(3, name="out")])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    return model


def test_model_parallel_builds_the_model_once_from_the_seed_one_device_builds_it_from():
    """The same seed gives the same initial weights, and the same training, split into stages or not."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)).astype("float32"), rng.integers(0, 3, 64)
    runs = {}
    for strategy, options in (("one_device", {}), ("model_parallel", dict(stages=("hidden",), virtual_cpus=2))):
        calls = []

        def model_fn():
            calls.append(1)
            return _small_chain()

        start = gpupar.fit(model_fn, x, y, batch_size=16, epochs=0, strategy=strategy, save=False, verbose=0, seed=4,
                           **options)
        trained = gpupar.fit(_small_chain, x, y, batch_size=16, epochs=2, strategy=strategy, save=False, verbose=0,
                             shuffle=False, seed=4, **options)
        runs[strategy] = start.model.get_weights(), trained.history["loss"]
        assert len(calls) == 1, strategy  # model_fn ran once
    (one_start, one_loss), (split_start, split_loss) = runs["one_device"], runs["model_parallel"]
    assert all(np.array_equal(a, b) for a, b in zip(one_start, split_start))
    assert split_loss == pytest.approx(one_loss, rel=1e-5)
