"""A model's own train_step (and test_step), run on every replica as model.fit runs it, K steps per call.

GANs, distillation, VAEs and contrastive models override `keras.Model.train_step`: the step,
its optimizers (a GAN keeps two as attributes), its losses and its metrics are the model's.
gpupar runs it as model.fit does under a strategy, inside `strategy.run` on each replica's share
of the batch, the logs it returns averaged over the replicas, and around it gpupar's own call of
K steps (gpupar.training.inner_loop), its loop, checkpoints and exact resume.

What gpupar's own step guarantees and a model's own step decides for itself: the loss's
reduction over the global batch (Keras' loss objects divide by the replica count, which the
optimizer's sum over replicas undoes; `global_mean` reduces per-example values as gpupar's own
step does). What still holds: Keras' random layers and SeedGenerators draw apart on each replica,
batch-norm statistics are averaged over the replicas, and the optimizers' all-reduce is Keras'.
"""

import logging

import keras
import numpy as np
import tensorflow as tf

from gpupar import keras_compat
from gpupar.errors import GpuparError
from gpupar.training.checkpoint import inexact_resume_note, unsaved_draws
from gpupar.training.inner_loop import SUM, Results
from gpupar.training.loss import len_rows, summed_over_replicas
from gpupar.training.steps.kind import StepKind, StepRequest
from gpupar.training.steps.step import Step

log = logging.getLogger("gpupar")
MEAN = tf.distribute.ReduceOp.MEAN
_KERAS_MODEL = keras.Model


def has_own_step(model) -> bool:
    """Whether the model's class overrides train_step, or compute_loss (which Keras' own train_step then calls).

    Either way the step is the model's: gpupar runs its train_step (Keras' around its own
    compute_loss) as model.fit does. A test_step alone is refused.

    Raises:
      GpuparError: the class overrides test_step but neither train_step nor compute_loss.
    """
    own_train = type(model).train_step is not _KERAS_MODEL.train_step
    own_loss = type(model).compute_loss is not _KERAS_MODEL.compute_loss
    if not own_train and not own_loss and type(model).test_step is not _KERAS_MODEL.test_step:
        raise GpuparError(f"{type(model).__name__} overrides test_step but not train_step; gpupar trains such a model "
                          "with its own step, which evaluates with the compiled loss and metrics: override train_step "
                          "too, or put the evaluation in the compiled metrics")
    return own_train or own_loss


def own_step_note(model) -> str:
    """The log line that says what gpupar leaves to a model's own train_step, and what it still does."""
    name = type(model).__name__
    step = (f"{name}'s own train_step" if type(model).train_step is not _KERAS_MODEL.train_step
            else f"Keras' train_step around {name}'s own compute_loss")
    return (f"step: {step} on each replica, as model.fit runs it; its losses are its "
            "own (Keras' loss objects are right across replicas; gpupar.global_mean reduces per-example values over "
            "the global batch; a value it logs from a loss object reads 1/replicas of it, as under model.fit), while "
            "random draws differ per replica and batch-norm statistics are averaged")


def global_mean(values, sample_weight=None):
    """The mean of per-example values over the GLOBAL batch, from inside one replica's step.

    Each replica returns its sum divided by the count (or the sum of sample weights) over all
    replicas, so the replicas' values add up to the global batch's mean, and the optimizer's sum
    of the replicas' gradients is the gradient of that mean: gpupar's own step reduces its loss
    so, a last uneven batch included. Outside a strategy it is the plain (weighted) mean.

    Args:
      values: Per-example values, any shape; every element counts once.
      sample_weight: Weights broadcastable to `values`, or None.

    Returns:
      A float32 scalar: this replica's share of the global mean.
    """
    values = tf.cast(values, tf.float32)
    weights = tf.ones_like(values) if sample_weight is None else tf.broadcast_to(
        tf.cast(sample_weight, tf.float32), tf.shape(values))
    total, count = tf.reduce_sum(values * weights), tf.reduce_sum(weights)
    return tf.math.divide_no_nan(total, summed_over_replicas(count))


def _checked_logs(model, logs, step_name):
    """The step's logs as {name: float32 scalar}, or a one-line error naming the model's class."""
    where = f"{type(model).__name__}.{step_name}"
    if not isinstance(logs, dict) or not all(isinstance(k, str) for k in logs):
        raise GpuparError(f"{where} returned a {type(logs).__name__}; return a dict of scalars such as "
                          "{'d_loss': ..., 'g_loss': ...}, as Keras' train_step does")
    checked = {}
    for name, value in _flat_logs(logs):
        try:
            value = tf.convert_to_tensor(value)
        except (TypeError, ValueError):
            raise GpuparError(f"{where} returned {name!r} as a {type(value).__name__}; each value it returns must be "
                              "one number (a metric's result(), a mean loss)") from None
        if value.shape.rank != 0 or not (value.dtype.is_floating or value.dtype.is_integer):
            raise GpuparError(f"{where} returned {name!r} of shape {value.shape.as_list()} and dtype {value.dtype.name}; "
                              "each value it returns must be one number (a metric's result(), a mean loss)")
        checked[name] = tf.cast(value, tf.float32)
    return checked


def _flat_logs(logs):
    """(name, value) of the logs, a dict among them (a CompileMetrics' result()) spread into its items as Keras does."""
    for name, value in logs.items():
        if isinstance(value, dict):
            yield from _flat_logs(value)
        else:
            yield name, value


def _step_logs(model, step_name, batch):
    """The model's train_step or test_step on this replica's batch, with replica-apart random draws; its checked logs.

    Not converted by AutoGraph (no tf.function of gpupar's is), as model.fit does not convert a
    train_step: Python control flow in it runs once, when it is traced.
    """
    with keras_compat.in_replica(undivided_losses=False):
        logs = getattr(model, step_name)(batch)
    return _checked_logs(model, logs, step_name)


class OwnStep(Step):
    """The model's own train_step and test_step, as Keras' fit runs them: on every replica, the logs averaged.

    Each is one tf.function that runs the model's step on every replica (strategy.run) and
    averages its logs over them, as Keras' own train function does; traced once, on the input's
    shapes, before training (`traced`): its logs' names are the K-steps call's, what its first
    trace makes (the optimizers' variables) exists before a checkpoint is restored, and what it
    returns is checked before any is written. The K-steps call runs it, across the replicas,
    keeping the rows summed and the last step's logs. Its metrics live in the model: reset when
    an epoch begins and before each evaluation, as model.fit does, and checkpointed, so that an
    epoch resumed mid-way reports the whole epoch.

    Attributes:
      strategy: The strategy it runs on every replica of.
      names: The names of the logs train_step returns, in order.
      eval_names: The names of the logs test_step returns ([] without evaluation data).
    """

    runs_replicas = True  # its functions run the replicas themselves (strategy.run): the K-steps call does not

    def __init__(self, strategy, model, element_spec, eval_spec=None, jit_compile: bool = False):
        self.strategy, self.model, self.jit_compile = strategy, model, jit_compile
        self.optimizer = model.optimizer
        self.first_step_check = FirstStepCheck(model)
        self.one_train = self._one_step("train_step")
        self.one_test = self._one_step("test_step") if eval_spec is not None else None
        self.names = self.traced(self.one_train, element_spec, "train_step")
        self.eval_names = self.traced(self.one_test, eval_spec, "test_step") if eval_spec is not None else []

    def _one_step(self, step_name):
        """A tf.function(batch) -> (rows, logs): the model's step on every replica's share, the logs averaged."""
        strategy, model = self.strategy, self.model

        def one_step(batch):
            rows, logs = strategy.run(lambda share: (tf.cast(len_rows(share), tf.float32), _step_logs(model, step_name, share)),
                                      args=(batch,))
            return strategy.reduce(SUM, rows, axis=None), {name: strategy.reduce(MEAN, value, axis=None)
                                                           for name, value in logs.items()}

        return tf.function(one_step, autograph=False, jit_compile=self.jit_compile and step_name == "train_step")

    def traced(self, function, element_spec, step_name) -> list:
        """Traces the step's function on the input's spec, as training will call it; the names of its logs, in order.

        An optimizer that builds itself inside the trace makes its variables outside it
        (keras_compat.optimizers_built_outside). A train_step that draws with random ops no
        checkpoint can hold is said in the log.

        Raises:
          GpuparError: the step returns something other than a dict of scalars.
        """
        with self.in_call(), keras_compat.optimizers_built_outside(optimizers_of(self.model), self.strategy):
            concrete = function.get_concrete_function(element_spec)
        draws = unsaved_draws(concrete.graph) if step_name == "train_step" else []
        if draws:
            log.warning(inexact_resume_note(f"{type(self.model).__name__}.{step_name}", draws))
        return list(concrete.structured_outputs[1])

    def train_zeros(self):
        return 0.0, {name: 0.0 for name in self.names}

    def train_step(self, batch, states):
        return self.one_train(batch), states

    def test_zeros(self):
        return 0.0, {name: 0.0 for name in self.eval_names}

    def test_step(self, batch, states):
        return self.one_test(batch), states

    def combine(self, totals, values):
        return totals[0] + values[0], values[1]  # the rows add up; the logs are the last step's

    def results(self, num_steps, totals, waited, busy) -> Results:
        rows, logs = totals
        return Results(num_steps, 0.0, float(rows), waited, busy, step_logs={name: float(value) for name, value in
                                                                             logs.items()})

    def step_logs(self, totals) -> dict:
        return {name: float(value) for name, value in totals[1].items()}

    def before_call(self):
        self.first_step_check.before()

    def after_call(self):
        self.first_step_check.after()


def optimizers_of(model) -> list:
    """The Keras optimizers the model holds (compile's, and those its compile keeps as attributes), each once."""
    found, seen = [], set()
    for value in [getattr(model, "optimizer", None), *vars(model).values()]:
        if isinstance(value, keras.optimizers.Optimizer) and id(value) not in seen:
            found.append(value)
            seen.add(id(value))
    return found


class FirstStepCheck:
    """Checks, after the first call, that the model's own step updated something: an optimizer's count or a weight.

    A train_step that updates no variable trains nothing; said in one line naming the class,
    before the first checkpoint is written.
    """

    def __init__(self, model):
        self.model, self.checked = model, False
        self.counts = self.sums = None

    def before(self):
        if not self.checked:
            self.counts = [int(o.iterations.numpy()) for o in optimizers_of(self.model)]
            self.sums = [float(np.sum(np.abs(w.numpy()))) for w in self.model.trainable_weights]

    def after(self):
        if self.checked:
            return
        self.checked = True
        counts = [int(o.iterations.numpy()) for o in optimizers_of(self.model)]
        sums = [float(np.sum(np.abs(w.numpy()))) for w in self.model.trainable_weights]
        if counts == self.counts and sums == self.sums:
            raise GpuparError(f"{type(self.model).__name__}.train_step updated no variable in its first steps (no "
                              "optimizer applied gradients, no weight changed); call an optimizer's apply_gradients "
                              "(or apply) on the gradients in train_step")


class OwnKind(StepKind):
    """A model whose class overrides train_step or compute_loss, trained by its own step (OwnStep), as model.fit runs it.

    It runs where replicas step together under a tf.distribute strategy, and refuses what would
    change its updates (accumulation, skipped steps, mixed_float16's loss scaling).
    """

    name = "own"
    own_update = True

    def applies(self, model, placement) -> bool:
        return has_own_step(model)

    def refusal(self, model, mode, options):
        name = type(model).__name__
        if not mode.replicas_step_together:
            return (f"{name} has its own train_step, which the {mode.name} mode cannot run (its step is gpupar's, split "
                    "over stages or workers); train it with strategy=mirrored, one_device, central_storage or "
                    "multi_worker_mirrored")
        if options.accumulate_steps > 1:
            return (f"{name} has its own train_step, which applies its own updates: accumulate_steps="
                    f"{options.accumulate_steps} cannot add up its gradients; use accumulate_steps=1 (or accumulate "
                    "in the step)")
        if options.nan_policy == "skip":
            return (f"{name} has its own train_step, which applies its own updates: nan_policy=skip cannot drop them; "
                    "use nan_policy=stop (training stops at a non-finite log, the last checkpoint kept)")
        if options.precision == "mixed_float16":
            return (f"{name} has its own train_step, whose optimizers do not scale the loss as mixed_float16 needs; use "
                    "precision=mixed_bfloat16 or float32, or wrap them in keras.optimizers.LossScaleOptimizer in the "
                    "model and keep precision=float32")
        return None

    def build(self, request: StepRequest) -> OwnStep:
        """The OwnStep, traced on the input's shapes before any restore."""
        placement, strategy = request.placement, request.placement.strategy
        per_pipeline = placement.replicas // placement.input_pipelines
        spec = request.train.distribute(strategy, request.global_batch, 0, None, per_pipeline).element_spec
        eval_spec = None
        if request.validation is not None:
            eval_spec = request.validation.distribute_validation(strategy, request.eval_batch, per_pipeline,
                                                                 request.validation_steps)[0].element_spec
        log.info(own_step_note(request.model))
        return OwnStep(strategy, request.model, spec, eval_spec, request.options.jit_compile)
