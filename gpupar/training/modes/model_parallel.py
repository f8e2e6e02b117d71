"""Model parallelism: one model's stages on consecutive devices, pipelined over micro-batches.

    gpupar --model=lstm --strategy=model_parallel --virtual_cpus=3 --microbatches=4 \
        --dataset=fashion_mnist --data_dir=/usr/share/datasets/fashion-mnist --epochs=2
    gpupar.fit(model_fn, (x, y), strategy="model_parallel", stages=("conv_out",), microbatches=4)

Stage k's layers build their variables under tf.device(stage k's device) (gpupar.models.staged),
and its forward and backward ops are created under the same tf.device, one GradientTape per stage
and micro-batch; activations go forward and their gradients back between devices as tensors
(TensorFlow inserts the Send/Recv). GPipe-style: every micro-batch's gradients are summed on
the variables' devices, then one optimizer update per batch. Everything is one tf.function, so
TensorFlow's executor starts each op as soon as its inputs are ready: stage k's forward on
micro-batch i+1 does not depend on stage k+1's work on micro-batch i, and the two can overlap.
"""

import logging

import numpy as np
import tensorflow as tf

from gpupar.config import MODEL_PARALLEL
from gpupar.errors import GpuparError
from gpupar.models.staged import build_on_stages, chain_layers
from gpupar.runtime.stages import StagePlan, plan_stages, stage_of_layers
from gpupar.runtime.strategy import detected_plan, short_name
from gpupar.training.engine import Placement, no_evaluation
from gpupar.training.inner_loop import steps_in_one_call, timed_loop_iterations, unpack, weighed
from gpupar.training.objective import len_rows
from gpupar.training.modes.mode import Mode, refuse_own_step, timed_calls
from gpupar.training.step import make_evaluation

log = logging.getLogger("gpupar")

ZERO = tf.UnconnectedGradients.ZERO


def pieces(x, n):
    """x split along the batch into n consecutive pieces (equal when the size allows)."""
    if n == 1:
        return [x]
    if x.shape[0] is not None and x.shape[0] % n == 0:
        return tf.split(x, n)
    size = tf.shape(x)[0]
    bounds = [(i * size) // n for i in range(n + 1)]
    return [x[bounds[i]:bounds[i + 1]] for i in range(n)]


class Stages:
    """The layers of a chain model grouped into stages and run on a StagePlan's devices.

    Micro-batch i of replica r is piece r * microbatches + i of the batch; its stage k runs on
    plan.replicas[r][k], forward ops in name scope forward_r{r}_s{k}_m{i} (TensorFlow names their
    gradient ops gradient_tape/.../forward_r{r}_s{k}_m{i}/...), gradient sums in accumulate_*.
    The loss and metrics are the run's Objective: the last stage records each micro-batch's
    weighted loss sums, and their gradients are taken with the whole batch's denominators, so
    the update is the one of the whole batch on one device.
    """

    def __init__(self, model, stage_of, plan: StagePlan, objective, microbatches: int = 1):
        layers = chain_layers(model)
        self.model, self.plan, self.objective, self.microbatches = model, plan, objective, microbatches
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

    def gradients(self, batch):
        """(loss, metric states, gradients in model.trainable_variables order) for one global batch.

        The loss is the objective's over the global batch plus the regularisation losses, what one
        device computes for the whole batch; the gradients are its gradients.
        """
        plan, num_m, num_s, objective = self.plan, self.microbatches, self.plan.num_stages, self.objective
        parts = self._micro_batches(batch)
        numerators, denominators, states, taped = {}, [], [], {}
        for i in range(num_m):  # forward: the order of creation is not the order of execution
            for r, devices in enumerate(plan.replicas):
                x, y, sample_weight = parts[r * num_m + i]
                tapes = []
                out = self._outputs(devices, r, i, x, True, tapes)
                tape = tapes[-1][0]
                with tf.device(devices[-1]), tf.name_scope(f"forward_r{r}_s{num_s - 1}_m{i}"), tape:
                    y_pred = tf.nest.map_structure(lambda t: tf.cast(t, tf.float32), out)
                    numerators[r, i], denominator = objective.terms(y, y_pred, sample_weight)
                    states.append(objective.metric_states(y, y_pred, sample_weight))
                denominators.append(denominator)
                taped[r, i] = tapes
        with tf.device(plan.variable_devices[-1]):
            scale = tf.math.divide_no_nan(1.0, objective.added_denominators(denominators))
        per_stage = [[[] for _ in plan.replicas] for _ in range(num_s)]
        for i in range(num_m):  # backward, stage by stage from the last, each on its stage's device
            for r, devices in enumerate(plan.replicas):
                upstream = scale
                for k in reversed(range(num_s)):
                    tape, x, out = taped[r, i][k]
                    target = numerators[r, i] if k == num_s - 1 else out
                    with tf.device(devices[k]):
                        sources = [*self.variables[k], x] if k else self.variables[k]
                        grads = tape.gradient(target, sources, output_gradients=upstream, unconnected_gradients=ZERO)
                    per_stage[k][r].append(grads[:len(self.variables[k])])
                    upstream = grads[-1] if k else None
        stage_grads = [self._accumulate(k, per_stage[k]) for k in range(num_s)]
        with tf.device(plan.variable_devices[-1]):
            loss = tf.add_n([tf.reduce_sum(n * scale) for n in numerators.values()]
                            + [reg for _, reg in stage_grads if reg is not None])
            summed_states = [tf.add_n(list(s)) for s in zip(*states)]
        by_id = {id(v): g for k in range(num_s) for v, g in zip(self.variables[k], stage_grads[k][0])}
        return loss, summed_states, [by_id[id(v)] for v in self.model.trainable_variables]

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

    def evaluate(self, batch):
        """(loss numerators, denominators, metric states) of one batch, with inference behaviour, pipelined."""
        plan, num_m, objective = self.plan, self.microbatches, self.objective
        parts = self._micro_batches(batch)
        numerators, denominators, states = [], [], []
        for i in range(num_m):
            for r, devices in enumerate(plan.replicas):
                x, y, sample_weight = parts[r * num_m + i]
                y_pred = tf.nest.map_structure(lambda t: tf.cast(t, tf.float32),
                                               self._outputs(devices, r, i, x, False))
                numerator, denominator = objective.terms(y, y_pred, sample_weight)
                numerators.append(numerator)
                denominators.append(denominator)
                states.append(objective.metric_states(y, y_pred, sample_weight))
        return (tf.add_n(numerators), objective.added_denominators(denominators),
                [tf.add_n(list(s)) for s in zip(*states)])


def make_train_function(stages: Stages, optimizer, parallel_iterations: int = 1):
    """Returns train(iterator, num_steps, skip_first_wait) -> ((loss sum, metric states), input wait s, step s).

    One tf.function call of num_steps pipelined steps, timed as the synchronous steps are
    (parallel_iterations: gpupar.training.inner_loop.timed_loop_iterations).
    """

    def batch_step(batch):
        loss, states, grads = stages.gradients(batch)
        # Keras applies each variable's update colocated with the variable: on its stage's device.
        optimizer.apply(grads, stages.model.trainable_variables)
        return (*weighed(loss, len_rows(unpack(batch)[0])), states)

    return steps_in_one_call(batch_step, (0.0, 0.0, 0.0, stages.objective.zero_states()), timed=True,
                             parallel_iterations=parallel_iterations)


def make_evaluate_function(stages: Stages):
    """Returns evaluate(iterator, num_steps) -> (loss numerators, denominators, metric states), as the steps'."""
    terms = np.zeros(len(stages.objective.losses), np.float32)
    return steps_in_one_call(stages.evaluate, (terms, terms, stages.objective.zero_states()))


class ModelParallel(Mode):
    """strategy=model_parallel: a chain model's stages on consecutive devices, each batch pipelined as micro-batches."""

    name = MODEL_PARALLEL

    def selected(self, distribution, cluster) -> bool:
        return distribution.strategy == MODEL_PARALLEL

    def refuse_elsewhere(self, distribution):
        if distribution.microbatches != 1:
            raise GpuparError(f"microbatches={distribution.microbatches} pipelines the stages of "
                              "strategy=model_parallel; pass strategy=model_parallel, or microbatches=1")
        if distribution.stages is not None:
            raise GpuparError(f"stages={','.join(map(str, distribution.stages))} splits a model for "
                              "strategy=model_parallel; pass strategy=model_parallel, or no stages")

    def refuse(self, config):
        refuse_own_step(config, MODEL_PARALLEL, pipelined=True)
        microbatches = config.distribution.microbatches
        for option in ("batch_size", "per_replica_batch_size"):
            batch = getattr(config.input, option)
            if batch is not None and batch % microbatches:
                raise GpuparError(f"{option}={batch} does not split into microbatches={microbatches} equal "
                                  f"micro-batches; choose a {option} that is a multiple of microbatches")

    def refuse_task(self, task, config):
        for adapter in (task.train, task.evaluation):
            if adapter is not None and adapter.per_replica_batches:
                raise GpuparError(f"{adapter.role} is {adapter.form}, which gives per-replica batches; "
                                  "strategy=model_parallel splits each global batch itself: give arrays, a dataset or "
                                  "a TFDS name")
        if config.distribution.stages is None:
            raise GpuparError("strategy=model_parallel needs stages: the layers after which a new stage starts, by name "
                              "or index, e.g. stages=('conv_out',) for two stages")

    def place(self, config, cluster) -> Placement:
        distribution = config.distribution
        devices = detected_plan("auto", distribution.devices, max_cpus=config.device_setup.virtual_cpus or 1).devices
        plan = plan_stages(devices, len(distribution.stages) + 1)
        description = f"{plan.describe()}; {distribution.microbatches} micro-batch(es) per replica"
        # Each stage places its variables itself (tf.device): the default strategy's scope.
        return Placement(description, tf.distribute.get_strategy(), plan.num_replicas, plan.num_replicas, devices,
                         stage_devices=plan.variable_devices, stage_ends=distribution.stages, plan=plan)

    def build_model(self, build, placement, sample):
        return build_on_stages(build, placement.stage_ends, placement.stage_devices)[0]

    def build(self, prepared):
        placement, model = prepared.placement, prepared.model
        layers = chain_layers(model)
        stage_of = stage_of_layers([layer.name for layer in layers], placement.stage_ends)
        stages = Stages(model, stage_of, placement.plan, prepared.objective, prepared.distribution.microbatches)
        for line in stages.describe():
            log.info(line)
        run_steps = timed_calls(make_train_function(stages, prepared.optimizer, timed_loop_iterations(placement.on_gpus)))

        def make_input(first_step, limit=None):
            return iter(prepared.train.batches(prepared.global_batch, first_step, limit))

        evaluate = no_evaluation
        if prepared.evaluation is not None:
            dataset, steps = prepared.evaluation.evaluation(prepared.eval_batch, prepared.input.validation_steps)
            evaluate = make_evaluation(make_evaluate_function(stages), iter(dataset), steps,
                                       prepared.objective, model)
        return prepared.engine(make_input, run_steps, evaluate)
