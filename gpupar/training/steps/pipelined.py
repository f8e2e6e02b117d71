"""The pipelined step of model parallelism: a chain model's stages on consecutive devices, over micro-batches.

Stage k's layers have their variables on stage k's device (gpupar.models.staged), and its
forward and backward ops are created under the same tf.device, one GradientTape per stage and
micro-batch; activations go forward and their gradients back between devices as tensors
(TensorFlow inserts the Send/Recv). GPipe-style: every micro-batch's gradients are summed on
the variables' devices, then one optimizer update per batch. Everything is one tf.function, so
TensorFlow's executor starts each op as soon as its inputs are ready: stage k's forward on
micro-batch i+1 does not depend on stage k+1's work on micro-batch i, and the two can overlap.
"""

import logging

import tensorflow as tf

from gpupar.models.staged import chain_layers
from gpupar.runtime.stages import StagePlan, stage_of_layers
from gpupar.runtime.strategy import short_name
from gpupar.training.inner_loop import unpack
from gpupar.training.loss import len_rows, micro_batch, replica_loss, track_loss
from gpupar.training.steps.compiled import KerasCompiledStep, check_compiled
from gpupar.training.steps.kind import StepKind, StepRequest
from gpupar.training.steps.parts import updated_metrics

ZERO = tf.UnconnectedGradients.ZERO
log = logging.getLogger("gpupar")


def pieces(x, n):
    """x split along the batch into n consecutive pieces (equal when the size allows)."""
    if n == 1:
        return [x]
    if x.shape[0] is not None and x.shape[0] % n == 0:
        return tf.split(x, n)
    size = tf.shape(x)[0]
    bounds = [(i * size) // n for i in range(n + 1)]
    return [x[bounds[i]:bounds[i + 1]] for i in range(n)]


class PipelineStep(KerasCompiledStep):
    """A chain model's stages on a StagePlan's devices, each global batch pipelined as micro-batches.

    Micro-batch i of replica r is piece r * microbatches + i of the batch; its stage k runs on
    plan.replicas[r][k], forward ops in name scope forward_r{r}_s{k}_m{i} (TensorFlow names their
    gradient ops gradient_tape/.../forward_r{r}_s{k}_m{i}/...), gradient sums in accumulate_*.
    The loss and metrics are Keras' compiled ones: the last stage computes each micro-batch's
    share of the whole batch's loss (gpupar.training.loss.micro_batch), so the update is the one
    of the whole batch on one device, and updates the metrics with each micro-batch's outputs.
    """

    def __init__(self, model, stage_of, plan: StagePlan, optimizer, microbatches: int = 1):
        super().__init__(model, optimizer)
        layers = chain_layers(model)
        self.plan, self.microbatches = plan, microbatches
        self.stages = [[layer for layer, s in zip(layers, stage_of) if s == k] for k in range(plan.num_stages)]
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

    def _micro_batches(self, batch):
        """[(x, y, sample_weight)] of every replica's micro-batches: piece r * microbatches + i."""
        count = self.plan.num_replicas * self.microbatches
        x, y, sample_weight = unpack(batch)
        split = [None if part is None else pieces(part, count) for part in (x, y, sample_weight)]
        return [tuple(None if parts is None else parts[j] for parts in split) for j in range(count)]

    def _outputs(self, devices, r, i, x, training, tapes=None):
        """The last stage's outputs (float32) of one micro-batch, each stage on its device; tapes kept if given."""
        for k in range(self.plan.num_stages):
            with tf.device(devices[k]), tf.name_scope(f"forward_r{r}_s{k}_m{i}"):
                if tapes is None:
                    x = self._stage(k, x, training)
                    continue
                with tf.GradientTape() as tape:
                    if k:
                        tape.watch(x)
                    out = self._stage(k, x, training)
                tapes.append([tape, x, out])
                x = out
        return x

    def _share(self, parts, j, y_pred, batch_rows, whole_weight, states):
        """Micro-batch j's share of the whole batch's loss (what is differentiated, its value), the new metric states.

        Its loss over the whole batch (gpupar.training.loss.micro_batch), Keras' compiled metrics
        updated with its outputs (parts.updated_metrics).
        """
        x, y, sample_weight = parts[j]

        def loss_and_metrics():
            with micro_batch(len_rows(x), batch_rows, whole_weight):
                loss, share = replica_loss(self.model, y, y_pred, sample_weight)
            self.model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            return loss, share

        return updated_metrics(self.metrics, states, loss_and_metrics)

    def gradients(self, batch, states):
        """(loss, gradients in model.trainable_variables order, the new metric states) for one global batch.

        The loss is the compiled loss over the global batch plus the regularisation losses, what
        one device computes for the whole batch; the gradients are its gradients.
        """
        plan, num_m, num_s = self.plan, self.microbatches, self.plan.num_stages
        parts = self._micro_batches(batch)
        x, _, sample_weight = unpack(batch)
        rows = len_rows(x)
        losses, shares, taped = {}, [], {}
        for i in range(num_m):  # forward: the order of creation is not the order of execution
            for r, devices in enumerate(plan.replicas):
                tapes = []
                out = self._outputs(devices, r, i, parts[r * num_m + i][0], True, tapes)
                tape = tapes[-1][0]
                with tf.device(devices[-1]), tape:  # the metrics' ops are no stage's, so outside its name scope
                    (losses[r, i], share), states = self._share(parts, r * num_m + i, out, rows, sample_weight, states)
                shares.append(share)
                taped[r, i] = tapes
        per_stage = [[[] for _ in plan.replicas] for _ in range(num_s)]
        for i in range(num_m):  # backward, stage by stage from the last, each on its stage's device
            for r, devices in enumerate(plan.replicas):
                upstream = None
                for k in reversed(range(num_s)):
                    tape, x, out = taped[r, i][k]
                    target = losses[r, i] if k == num_s - 1 else out
                    with tf.device(devices[k]):
                        sources = [*self.variables[k], x] if k else self.variables[k]
                        grads = tape.gradient(target, sources, output_gradients=upstream, unconnected_gradients=ZERO)
                    per_stage[k][r].append(grads[:len(self.variables[k])])
                    upstream = grads[-1] if k else None
        stage_grads = [self._accumulate(k, per_stage[k]) for k in range(num_s)]
        with tf.device(plan.variable_devices[-1]):
            loss = tf.add_n(shares + [reg for _, reg in stage_grads if reg is not None])
        by_id = {id(v): g for k in range(num_s) for v, g in zip(self.variables[k], stage_grads[k][0])}
        return loss, [by_id[id(v)] for v in self.model.trainable_variables], states

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

    def train_step(self, batch, states):
        """One pipelined step: every micro-batch forward and backward, then one update of every stage's variables.

        Keras applies each variable's update colocated with the variable: on its stage's device.
        """
        loss, grads, states = self.gradients(batch, states)
        self.optimizer.apply(grads, self.model.trainable_variables)
        rows = tf.cast(len_rows(unpack(batch)[0]), tf.float32)
        _, states = updated_metrics(self.metrics, states, lambda: track_loss(self.model, loss, rows))
        return (loss * rows, rows), states

    def test_step(self, batch, states):
        """Keras' test step for one batch, pipelined: the loss over the whole batch, the metrics updated."""
        plan, num_m = self.plan, self.microbatches
        parts = self._micro_batches(batch)
        x, _, sample_weight = unpack(batch)
        rows = len_rows(x)
        shares = []
        for i in range(num_m):
            for r, devices in enumerate(plan.replicas):
                y_pred = self._outputs(devices, r, i, parts[r * num_m + i][0], False)
                with tf.device(devices[-1]):
                    (_, share), states = self._share(parts, r * num_m + i, y_pred, rows, sample_weight, states)
                shares.append(share)
        added = [loss for stage in self.stages for layer in stage for loss in layer.losses]
        rows = tf.cast(rows, tf.float32)
        _, states = updated_metrics(self.metrics, states, lambda: track_loss(self.model, tf.add_n(shares + added), rows))
        return rows, states


class PipelinedKind(StepKind):
    """A compiled chain model whose stages a placement put on devices of their own (a StagePlan): PipelineStep."""

    name = "pipelined"

    def applies(self, model, placement) -> bool:
        return isinstance(placement.plan, StagePlan)

    def build(self, request: StepRequest) -> PipelineStep:
        model, distribution = request.model, request.mode.distribution
        check_compiled(model, request.train)
        stage_of = stage_of_layers([layer.name for layer in chain_layers(model)], distribution.stages)
        step = PipelineStep(model, stage_of, request.placement.plan, request.optimizer, distribution.microbatches)
        for line in step.describe():
            log.info(line)
        return step
