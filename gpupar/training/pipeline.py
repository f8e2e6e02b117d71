"""Model parallelism: one model's stages on consecutive devices, pipelined over micro-batches.

    gpupar --model=lstm --strategy=model_parallel --virtual_cpus=3 --microbatches=4 \
        --dataset=fashion_mnist --data_dir=/usr/share/datasets/fashion-mnist --epochs=2

Stage k's layers build their variables under tf.device(stage k's device) (gpupar.models.sequential),
and its forward and backward ops are created under the same tf.device, one GradientTape per stage
and micro-batch; activations go forward and their gradients back between devices as tensors
(TensorFlow inserts the Send/Recv). GPipe-style: every micro-batch's gradients are summed on
the variables' devices, then one optimizer update per batch. Everything is one tf.function, so
TensorFlow's executor starts each op as soon as its inputs are ready: stage k's forward on
micro-batch i+1 does not depend on stage k+1's work on micro-batch i, and the two can overlap.
"""

import keras
import numpy as np
import tensorflow as tf

from gpupar.errors import GpuparError
from gpupar.models.sequential import layer_stages
from gpupar.runtime.stages import StagePlan
from gpupar.runtime.strategy import short_name
from gpupar.training.steps import count_correct, steps_in_one_call

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
                                corrects.append(count_correct(out, y))
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

    def evaluate(self, images, labels):
        """(sum of the per-example losses, correct predictions, examples), with inference behaviour, pipelined."""
        plan, num_m = self.plan, self.microbatches
        xs, ys = _pieces(images, plan.num_replicas * num_m), _pieces(labels, plan.num_replicas * num_m)
        losses, corrects = [], []
        for i in range(num_m):
            for r, devices in enumerate(plan.replicas):
                x, y = xs[r * num_m + i], ys[r * num_m + i]
                for k in range(plan.num_stages):
                    with tf.device(devices[k]), tf.name_scope(f"forward_r{r}_s{k}_m{i}"):
                        x = self._stage(k, x, training=False)
                losses.append(tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(y, x, from_logits=True)))
                corrects.append(count_correct(x, y))
        return tf.add_n(losses), tf.add_n(corrects), tf.cast(tf.shape(labels)[0], tf.float32)


def make_train_function(pipeline: Pipeline, optimizer, global_batch: int):
    """Returns train(iterator, num_steps, skip_first_wait) -> ((loss sum, accuracy state), input wait s, step s).

    One tf.function call of num_steps pipelined steps, timed as the synchronous steps are; the
    accuracy state is SparseCategoricalAccuracy's, (correct, examples).
    """

    def batch_step(batch):
        images, labels = batch
        loss, correct, grads = pipeline.gradients(images, labels, global_batch)
        # Keras applies each variable's update colocated with the variable: on its stage's device.
        optimizer.apply(grads, pipeline.model.trainable_variables)
        return loss, [correct, tf.cast(tf.shape(labels)[0], tf.float32)]

    return steps_in_one_call(batch_step, (0.0, [0.0, 0.0]), timed=True)


def make_evaluate_function(pipeline: Pipeline):
    """Returns evaluate(iterator, num_steps) -> (loss numerators, denominators, accuracy state), as the steps'."""

    def batch_step(batch):
        loss_sum, correct, count = pipeline.evaluate(*batch)
        return tf.stack([loss_sum]), tf.stack([count]), [correct, count]

    return steps_in_one_call(batch_step, (np.zeros(1), np.zeros(1), [0.0, 0.0]))
