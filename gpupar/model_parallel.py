"""Model parallelism: one model's stages on consecutive devices, pipelined over micro-batches.

    gpupar --model=lstm --strategy=model_parallel --virtual_cpus=3 --microbatches=4 \
        --dataset=fashion_mnist --data_dir=/usr/share/datasets/fashion-mnist --epochs=2

Stage k's layers build their variables under tf.device(stage k's device) (gpupar.model), and
its forward and backward ops are created under the same tf.device, one GradientTape per stage
and micro-batch; activations go forward and their gradients back between devices as tensors
(TensorFlow inserts the Send/Recv). GPipe-style: every micro-batch's gradients are summed on
the variables' devices, then one optimizer update per batch. Everything is one tf.function, so
TensorFlow's executor starts each op as soon as its inputs are ready: stage k's forward on
micro-batch i+1 does not depend on stage k+1's work on micro-batch i, and the two can overlap.
"""

import logging
import time

import keras
import tensorflow as tf

from gpupar import data
from gpupar.checkpoint import Checkpoints
from gpupar.errors import GpuparError
from gpupar.model import build_model, layer_stages, model_signature, num_stages
from gpupar.outputs import describe_outputs
from gpupar.result import FitResult
from gpupar.stages import StagePlan, plan_stages
from gpupar.strategy import plan_strategy, short_name
from gpupar.summaries import Summaries
from gpupar.teardown import keep_for_process
from gpupar.train import _correct, _Loop, make_finite_check, steps_in_one_call

log = logging.getLogger("gpupar")
ZERO = tf.UnconnectedGradients.ZERO


def _pieces(x, n):
    """x split along the batch into n consecutive pieces (equal when the size allows)."""
    if n == 1:
        return [x]
    if x.shape[0] is not None and x.shape[0] % n == 0:
        return tf.split(x, n)
    size = tf.shape(x)[0]
    bounds = [(i * size) // n for i in range(n + 1)]
    return [x[bounds[i]:bounds[i + 1]] for i in range(n)]


class Pipeline:
    """The layers of a gpupar Sequential model grouped into stages and run on a StagePlan's devices.

    Micro-batch i of replica r is piece r * microbatches + i of the batch; its stage k runs on
    plan.replicas[r][k], forward ops in name scope forward_r{r}_s{k}_m{i} (TensorFlow names their
    gradient ops gradient_tape/.../forward_r{r}_s{k}_m{i}/...), gradient sums in accumulate_*.
    """

    def __init__(self, model, plan: StagePlan, microbatches: int = 1):
        stage_of = layer_stages(model.layers)
        if stage_of[-1] + 1 != plan.num_stages:
            raise GpuparError(f"{model.name} has {stage_of[-1] + 1} stages but the plan has {plan.num_stages}")
        self.model, self.plan, self.microbatches = model, plan, microbatches
        self.stages = [[layer for layer, s in zip(model.layers, stage_of) if s == k] for k in range(plan.num_stages)]
        self.variables = [[v for layer in stage for v in layer.trainable_variables] for stage in self.stages]

    def describe(self):
        """One line per stage: its device, its layers, and where its variables really are."""
        lines = []
        for k, layers in enumerate(self.stages):
            placed = sorted({short_name(v.value.device) for layer in layers for v in layer.weights})
            devices = ", ".join(replica[k] for replica in self.plan.replicas)
            lines.append(f"stage {k} on {devices}: {', '.join(layer.name for layer in layers)} "
                         f"(variables on {', '.join(placed) or 'none'})")
        return lines

    def _stage(self, k, x, training):
        for layer in self.stages[k]:
            x = layer(x, training=training)
        return x

    def gradients(self, images, labels, global_batch: int):
        """(loss, correct predictions, gradients in model.trainable_variables order) for one batch.

        loss is the mean cross-entropy over the global batch plus the regularisation losses,
        exactly what one device computes for the whole batch; the gradients are its gradients.
        """
        plan, num_m, num_s = self.plan, self.microbatches, self.plan.num_stages
        xs, ys = _pieces(images, plan.num_replicas * num_m), _pieces(labels, plan.num_replicas * num_m)
        losses, corrects, taped = [], [], {}
        for i in range(num_m):  # forward: the order of creation is not the order of execution
            for r, devices in enumerate(plan.replicas):
                x, y, tapes = xs[r * num_m + i], ys[r * num_m + i], []
                for k in range(num_s):
                    with tf.device(devices[k]), tf.name_scope(f"forward_r{r}_s{k}_m{i}"):
                        with tf.GradientTape() as tape:
                            if k:
                                tape.watch(x)
                            out = self._stage(k, x, training=True)
                            if k == num_s - 1:
                                corrects.append(_correct(out, y))
                                per_example = keras.losses.sparse_categorical_crossentropy(y, out, from_logits=True)
                                out = tf.reduce_sum(per_example) / global_batch
                                losses.append(out)
                    tapes.append((tape, x, out))
                    x = out
                taped[r, i] = tapes
        per_stage = [[[] for _ in plan.replicas] for _ in range(num_s)]
        for i in range(num_m):  # backward, stage by stage from the last, each on its stage's device
            for r, devices in enumerate(plan.replicas):
                upstream = None
                for k in reversed(range(num_s)):
                    tape, x, out = taped[r, i][k]
                    with tf.device(devices[k]):
                        sources = [*self.variables[k], x] if k else self.variables[k]
                        grads = tape.gradient(out, sources, output_gradients=upstream, unconnected_gradients=ZERO)
                    per_stage[k][r].append(grads[:len(self.variables[k])])
                    upstream = grads[-1] if k else None
        stage_grads = [self._accumulate(k, per_stage[k]) for k in range(num_s)]
        with tf.device(plan.variable_devices[-1]):
            loss = tf.add_n(losses + [reg for _, reg in stage_grads if reg is not None])
            correct = tf.add_n(corrects)
        by_id = {id(v): g for k in range(num_s) for v, g in zip(self.variables[k], stage_grads[k][0])}
        return loss, correct, [by_id[id(v)] for v in self.model.trainable_variables]

    def _accumulate(self, k, replica_grads):
        """Stage k's gradients summed over micro-batches (on each replica's device), then replicas.

        The sum over replicas, and the regularisation loss with its gradients, are on the
        variables' device. Returns (gradients, regularisation loss or None).
        """
        summed = []
        for r, grads in enumerate(replica_grads):
            with tf.device(self.plan.replicas[r][k]), tf.name_scope(f"accumulate_r{r}_s{k}"):
                summed.append([tf.add_n(list(g)) for g in zip(*grads)])
        with tf.device(self.plan.variable_devices[k]), tf.name_scope(f"accumulate_s{k}"):
            with tf.GradientTape() as tape:
                penalties = [loss for layer in self.stages[k] for loss in layer.losses]
                reg = tf.add_n(penalties) if penalties else None
            total = [tf.add_n(list(g)) for g in zip(*summed)]
            if reg is not None:
                reg_grads = tape.gradient(reg, self.variables[k])  # None for unregularised ones
                total = [g if d is None else g + d for g, d in zip(total, reg_grads)]
        return total, reg

    def correct(self, images, labels):
        """(correct predictions, examples) with inference behaviour, pipelined like training."""
        plan, num_m = self.plan, self.microbatches
        xs, ys = _pieces(images, plan.num_replicas * num_m), _pieces(labels, plan.num_replicas * num_m)
        corrects = []
        for i in range(num_m):
            for r, devices in enumerate(plan.replicas):
                x = xs[r * num_m + i]
                for k in range(plan.num_stages):
                    with tf.device(devices[k]), tf.name_scope(f"forward_r{r}_s{k}_m{i}"):
                        x = self._stage(k, x, training=False)
                corrects.append(_correct(x, ys[r * num_m + i]))
        return tf.add_n(corrects), tf.cast(tf.shape(labels)[0], tf.float32)


def make_train_function(pipeline: Pipeline, optimizer, global_batch: int):
    """Returns train(iterator, num_steps[, skip_first_wait]) -> (loss sum, correct, input wait s, step s).

    One tf.function call of num_steps pipelined steps, timed as gpupar.train's steps are.
    """

    def batch_step(batch):
        images, labels = batch
        loss, correct, grads = pipeline.gradients(images, labels, global_batch)
        # Keras applies each variable's update colocated with the variable: on its stage's device.
        optimizer.apply(grads, pipeline.model.trainable_variables)
        return loss, correct

    return steps_in_one_call(batch_step, timed=True)


def make_test_function(pipeline: Pipeline):
    """Returns test(iterator, num_steps) -> (correct predictions, examples seen)."""
    return steps_in_one_call(lambda batch: pipeline.correct(*batch))


def detected_stage_plan(config) -> StagePlan:
    """The StagePlan for config on this machine's logical devices (GPUs, else the virtual CPUs)."""
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")][: config.virtual_cpus or 1]
    devices = plan_strategy("auto", gpus, cpus, devices=config.devices).devices
    return plan_stages(devices, num_stages(config))


def train_and_evaluate(config, stop, started) -> FitResult:
    """gpupar.train.train_and_evaluate for strategy=model_parallel (devices already configured)."""
    plan = detected_stage_plan(config)
    keras.utils.set_random_seed(config.seed)
    splits = data.load_splits(config.dataset, config.data_dir)
    log.info("data: %d training and %d test images from %s", len(splits.train_labels), len(splits.test_labels),
             config.data_dir or f"TFDS {config.dataset}")
    global_batch = config.batch_size * plan.num_replicas
    steps_per_epoch = data.batches_per_epoch(len(splits.train_images), global_batch)
    if config.steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, config.steps_per_epoch)

    model = build_model(config, stage_devices=plan.variable_devices)
    adam = keras.optimizers.Adam(config.learning_rate)
    adam.build(model.trainable_variables)  # each slot variable is created beside its variable
    pipeline = Pipeline(model, plan, config.microbatches)
    description = (f"{plan.describe()}; {config.microbatches} micro-batch(es) of "
                   f"{config.batch_size // config.microbatches} per replica")
    log.info(description)
    for line in pipeline.describe():
        log.info(line)

    checkpoints = Checkpoints(config.model_dir, model, adam, config.max_to_keep, global_batch, model_signature(config), config.save)
    saved_at = checkpoints.restore(config.resume)
    start = saved_at.rebatched(global_batch, steps_per_epoch)
    if start.step != saved_at.step:
        log.info("the checkpoint is %d steps of %d into epoch %d; this run continues at step %d",
                 saved_at.step, saved_at.global_batch, saved_at.epoch, start.step)
    adam.learning_rate.assign(config.learning_rate)

    train_iterator = keep_for_process(iter(data.train_dataset(
        splits.train_images, splits.train_labels, global_batch, config.seed,
        start_step=start.epoch * steps_per_epoch + start.step,
    )))
    test_iterator = keep_for_process(iter(data.test_dataset(splits.test_images, splits.test_labels, global_batch)))
    test, num_test_steps = make_test_function(pipeline), data.test_steps(len(splits.test_images), global_batch)

    def evaluate():
        correct, count = test(test_iterator, tf.constant(num_test_steps))
        return float(correct) / float(count)

    summaries = Summaries(config.log_dir)
    loop = _Loop(config, make_train_function(pipeline, adam, global_batch), evaluate, checkpoints, summaries,
                 steps_per_epoch, global_batch, adam.iterations, make_finite_check(model))
    try:
        history = loop.run(start, train_iterator, stop)
    finally:
        loop.profile.stop()
        summaries.close()
    test_accuracy = history[-1].test_accuracy if history else evaluate()
    total = time.perf_counter() - started
    log.info("Test accuracy: %.4f; total time: %.1f s", test_accuracy, total)
    result = FitResult(
        model=model, strategy=plan, history=history, test_accuracy=test_accuracy, total_seconds=total,
        strategy_description=description, replicas=plan.num_replicas, global_batch=global_batch,
        start_epoch=start.epoch, checkpoint=checkpoints.latest,
    )
    if config.metrics_json:
        result.write_json(config.metrics_json)
    log.info(describe_outputs(config, checkpoints.latest))
    return result

