"""A run's model and its optimizer(s), under the mode's placement: built by model_fn, given built, or rebuilt.

`model_and_optimizer` makes them for the one set-up (gpupar.training.setup): the model from the
task's model_fn in the run's dtype policy, or the model gpupar.fit was given (trained as it is
where it was built under the run's strategy, or rebuilt under it by Keras' own cloning, with its
weights and compile arguments), and the optimizer from the model's compile (kept as it is for a
given model, so its state carries from fit to fit) or from gpupar.fit's arguments. The model
ends compiled, and built as Keras' fit builds it before its first step (keras_compat.symbolic_build):
a model without an Input, its compiled metrics and loss, from one batch's shapes.
"""

import dataclasses
import logging
from typing import Any

import keras
import tensorflow as tf

from gpupar import keras_compat
from gpupar.errors import GpuparError
from gpupar.models.layers import replica_consistent_state
from gpupar.training.inner_loop import unpack
from gpupar.training.steps import step_kind
from gpupar.training.steps.own import optimizers_of

log = logging.getLogger("gpupar")


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What the model is trained with: its compile() arguments, or gpupar.fit's for an uncompiled model.

    Attributes:
      optimizer: A Keras optimizer, a function making one, its name, or None (Adam(learning_rate)).
      loss, loss_weights, metrics, weighted_metrics: As model.compile takes them.
      steps_per_execution: compile's steps_per_execution (1: not given).
      jit_compile: compile's jit_compile, resolved by Keras (False on a machine without accelerators).
      run_eagerly: compile's run_eagerly: Keras' debugging mode, every step run eagerly.
      by_user: Whether the model came compiled from model_fn.
    """

    optimizer: Any = None
    loss: Any = None
    loss_weights: Any = None
    metrics: Any = None
    weighted_metrics: Any = None
    steps_per_execution: int = 1
    jit_compile: bool = False
    by_user: bool = False
    run_eagerly: bool = False


@dataclasses.dataclass(frozen=True)
class BuiltModel:
    """A run's model and optimizers, made by model_and_optimizer.

    Attributes:
      model: The Keras model, built and compiled under the placement.
      placement: The placement it trains under (a model given built outside any strategy, on one
        device: TensorFlow's default strategy).
      compiled: Its Compiled arguments.
      kind: The kind of step that trains it (gpupar.training.steps.StepKind).
      variables: The variables the optimizer updates (the trainable ones, or their shards).
      optimizer: The optimizer whose state checkpoints hold (inside any loss-scale wrapper).
      update_optimizer: What applies the updates: the optimizer, or a loss-scale optimizer around it.
    """

    model: Any
    placement: Any
    compiled: Compiled
    kind: Any
    variables: Any
    optimizer: Any
    update_optimizer: Any


def compile_arguments(model, task, kind) -> Compiled:
    """The model's compile() arguments where model_fn compiled it, else gpupar.fit's loss, metrics and optimizer.

    A model whose own step applies its updates (kind.own_update) must come compiled: its compile
    says only the optimizer (its own, used as it is), steps_per_execution and jit_compile.

    Raises:
      GpuparError: a compiled model and fit's own loss, metrics or optimizer too.
    """
    if not getattr(model, "compiled", False):
        if kind.own_update:
            raise GpuparError(f"{type(model).__name__} has its own train_step and is not compiled; compile it in "
                              "model_fn as before model.fit (its step uses what compile gives it)")
        return Compiled(task.optimizer, task.loss, metrics=task.metrics)
    given = [name for name in ("loss", "metrics", "optimizer") if getattr(task, name) is not None]
    if given:
        raise GpuparError(f"model_fn returns a model compiled with its own {given[0]}, and gpupar.fit got {given[0]}= "
                          f"too; drop one of them (the rule: compile in model_fn, call gpupar.fit as model.fit)")
    settings = keras_compat.compile_settings(model)
    return Compiled(model.optimizer, model.loss, settings.get("loss_weights"), settings.get("metrics"),
                    settings.get("weighted_metrics"), int(model.steps_per_execution or 1), bool(model.jit_compile),
                    by_user=True, run_eagerly=bool(model.run_eagerly))


def model_and_optimizer(options, task, mode, placement, train) -> BuiltModel:
    """The run's model, its kind of step and its optimizers (BuiltModel).

    All are made under the placement's scope, the model's layers in the run's dtype policy. The
    kind of step is chosen as soon as the model exists (its refusals before a mode's own checks
    of the model). A model given built keeps its optimizer (and so its state from an earlier
    fit) where it trains as it is (_given_model); the placement is then the one it trains under.
    The model ends compiled with the optimizer that applies the updates, and built as Keras' fit
    builds it.
    """
    previous_policy = keras.config.dtype_policy()
    if options.precision != "float32":
        keras.config.set_dtype_policy(options.precision)  # the user's layers compute in 16 bits, weights stay float32
    try:
        model, moved = task.model, False
        if model is not None:
            placement, moved = _given_model(model, mode, placement, options)
        with placement.strategy.scope():
            with replica_consistent_state():  # the model's state only: the optimizer's keeps Keras' aggregation
                if model is None:
                    model = mode.build_model(lambda: _kind_checked(task.build_model(), mode, placement, options),
                                             placement)
                elif moved:
                    keras_compat.move_variables(model, placement.strategy)
            kind = step_kind(model, mode, placement, options)
            compiled = compile_arguments(model, task, kind)
            if kind.own_update and not moved:
                inner = applied = compiled.optimizer  # its own, built on the model's variables as model.fit builds it
            elif task.model is not None and compiled.by_user and not moved:
                inner, applied = _kept_optimizer(model.optimizer, options)
            else:  # a fresh one: from model_fn's compile, fit's arguments, or a moved model's compile
                inner = _optimizer(compiled.optimizer, options.learning_rate, used=task.model is not None)
                applied = _loss_scaled(inner, options)
            with replica_consistent_state():  # the compiled metrics' variables
                _compiled_for_the_run(model, compiled, applied, recompiled=moved and not kind.own_update)
            sample = train.sample()
            if not kind.own_update:
                _check_labels_given(compiled, sample)
            with replica_consistent_state():  # the variables of a model without an Input, made by Keras' build
                _built(model, sample, lenient=kind.own_update)
            updated, split = (model.trainable_variables, []) if kind.own_update else mode.updated_variables(model)
            if applied is not None and not applied.built:
                applied.build(updated)  # each slot variable is placed beside its variable
    finally:
        keras.config.set_dtype_policy(previous_policy)
    for line in split:
        log.info("variable %s", line)
    return BuiltModel(model, placement, compiled, kind, updated, inner, applied)


def _kind_checked(model, mode, placement, options):
    """The model model_fn returned, once a kind of step can train it here (step_kind's refusal, one line, else)."""
    step_kind(model, mode, placement, options)
    return model


def _check_labels_given(compiled: Compiled, sample):
    """Refuses a compiled loss or metrics without labels in the data (a tuple x is the model's inputs, as in Keras)."""
    if unpack(sample)[1] is not None:
        return
    if any(loss is not None for loss in tf.nest.flatten(compiled.loss)):
        raise GpuparError("the loss needs labels, but there is no y: pass y (gpupar.fit(model_fn, x, y, ...); as in "
                          "Keras a tuple x is the model's inputs), or train on x alone with a loss the model adds")
    if compiled.metrics or compiled.weighted_metrics:
        raise GpuparError("the metrics need labels, but there is no y: pass y, or no metrics")


def _built(model, sample, lenient: bool):
    """Builds the model, its compiled metrics and loss as Keras' fit does (keras_compat.symbolic_build).

    lenient: a model with its own train_step that Keras cannot build so (a compiled loss it never uses, on
    data without labels; no call() to build its compiled metrics with) is left to build itself
    when its step is first traced, as Keras' fit leaves a model made outside any strategy.

    Raises:
      GpuparError: what Keras found wrong building a compiled model on the first batch's shapes, in one line.
    """
    try:
        keras_compat.symbolic_build(model, sample)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
        if lenient:
            return
        raise GpuparError(f"Keras could not build {model.name} ({type(model).__name__}) on the training data's first "
                          f"batch: {type(e).__name__}: {_first_line(e)}") from e


def _first_line(error) -> str:
    """The first line of an error's message that says something (Keras' often start with a blank one)."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "")


def _compiled_for_the_run(model, compiled: Compiled, applied, recompiled: bool):
    """Leaves the model compiled as Keras' fit needs it, with `applied` as its optimizer; in the strategy's scope.

    A model that came compiled keeps its compile (its loss and metric objects; one whose variables
    moved under the strategy is compiled again with the same arguments and fresh metric objects,
    whose variables are made under it; one with its own train_step keeps its own compile, with
    the optimizer made again). One that did not is compiled with fit's loss and metrics, as the
    user would compile it.
    """
    if compiled.by_user and not recompiled:
        model.optimizer = applied  # where Keras' callbacks (ReduceLROnPlateau, LearningRateScheduler) look for it
        return
    model.compile(optimizer=applied, loss=compiled.loss, loss_weights=compiled.loss_weights,
                  metrics=_fresh(compiled.metrics), weighted_metrics=_fresh(compiled.weighted_metrics),
                  steps_per_execution=compiled.steps_per_execution, jit_compile=compiled.jit_compile,
                  run_eagerly=compiled.run_eagerly)


def _fresh(metrics):
    """The metrics as compile takes them, each keras.metrics.Metric object made again from its config."""
    if isinstance(metrics, keras.metrics.Metric):
        return metrics.__class__.from_config(metrics.get_config())
    if isinstance(metrics, dict):
        return {key: _fresh(value) for key, value in metrics.items()}
    if isinstance(metrics, (list, tuple)):
        return [_fresh(value) for value in metrics]  # a list, as compile asks (Keras 3.10 refuses a tuple)
    return metrics


def _given_model(model, mode, placement, options):
    """(the placement the given model trains under, whether its variables must move under the strategy first).

    A model built under the run's strategy trains as it is (so does one whose variables an
    earlier fit moved under it); one built outside any strategy trains as it is on one device
    (under TensorFlow's default strategy, as model.fit without one), and for several its
    variables are made again under the strategy, with their values, as if it had been built in
    the strategy's scope (keras_compat.move_variables): the same model object trains, whatever its
    class, and belongs to the strategy from then on.

    Raises:
      GpuparError: a mode that builds the model itself, a model of another strategy, precision
        for a built model.
    """
    if not mode.takes_built_model:
        raise GpuparError(f"strategy={mode.name} places the variables as it builds the model; pass a function that "
                          "builds and compiles it: gpupar.fit(model_fn, ...)")
    kind = step_kind(model, mode, placement, options)
    if options.precision != "float32":
        raise GpuparError(f"precision={options.precision} sets the dtype policy of the layers gpupar builds, and this "
                          f"model is built already: call keras.config.set_dtype_policy({options.precision!r}) before "
                          "building it (and drop precision)")
    made_under = strategy_of(model)
    if made_under is placement.strategy:
        return placement, False
    if made_under is not None:
        raise GpuparError(f"{model.name} was built under another strategy than this fit's ({placement.description}); "
                          "build it under gpupar.strategy(...) with the fit's options, or fit it without strategy "
                          "options")
    if placement.replicas == 1 and placement.workers == 1 and len(placement.devices) == 1:
        return dataclasses.replace(placement, strategy=tf.distribute.get_strategy()), False
    if kind.own_update and [o for o in optimizers_of(model) if o is not model.optimizer]:
        # Optimizers of its own, made outside, would apply their updates under no strategy.
        raise GpuparError(f"{model.name} ({type(model).__name__}) has its own train_step and optimizers of its own, "
                          "made outside any strategy; build and compile it under the strategy: strategy = "
                          "gpupar.strategy(...) first thing in the script, then `with strategy.scope():` around both")
    log.info("model: %s was built outside any strategy, so its variables are made again under this one, with their "
             "values, as if it had been built in its scope (its optimizer starts afresh, from its config); from now on "
             "it belongs to this strategy, for later fits and for Keras' evaluate and predict", model.name)
    return placement, True


def strategy_of(model):
    """The tf.distribute.Strategy whose scope the model was made in, None outside any (keras_compat.strategy_of)."""
    return keras_compat.strategy_of(model)


def _kept_optimizer(optimizer, options):
    """(the optimizer checkpoints hold, the one that applies updates) of a built model's own optimizer, kept as it is.

    Its state carries over from fit to fit, as Keras' does; a loss-scale optimizer (compile's,
    under mixed_float16) applies the updates itself.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer, optimizer
    return optimizer, _loss_scaled(optimizer, options)


def _optimizer(given, learning_rate: float, used: bool = False):
    """The optimizer to train with, made under the strategy's scope (Keras' optimizers must be).

    used: `given` may have trained already (a rebuilt model's): a fresh one is made from its config.
    """
    if given is None:
        return keras.optimizers.Adam(learning_rate)
    if isinstance(given, keras.optimizers.LossScaleOptimizer):
        given = given.inner_optimizer  # compile wraps it under mixed_float16; gpupar wraps it again as the run says
    if isinstance(given, str):
        try:
            made = keras.optimizers.get(given)
        except ValueError:
            raise GpuparError(f"optimizer={given!r} is not a Keras optimizer name; use one such as 'adam' or 'sgd', or "
                              "pass a keras.optimizers.Optimizer") from None
    elif callable(given) and not isinstance(given, keras.optimizers.Optimizer):
        made = given()  # a function that makes it: called here, under the strategy's scope
        if not isinstance(made, keras.optimizers.Optimizer):
            raise GpuparError(f"the optimizer function returned a {type(made).__name__}, not a "
                              "keras.optimizers.Optimizer")
    elif given.built and not used:
        raise GpuparError("the optimizer has been used already (it has variables); pass a new one: gpupar makes it "
                          "again under the strategy's scope from its config")
    else:
        made = given.__class__.from_config(given.get_config())
    if made.gradient_accumulation_steps:
        raise GpuparError(f"the optimizer has gradient_accumulation_steps={made.gradient_accumulation_steps}, Keras' "
                          "own accumulation, which gpupar does not run under a strategy; pass accumulate_steps="
                          f"{made.gradient_accumulation_steps} to gpupar instead (it adds up the batches' gradients in "
                          "the step, then all-reduces them once)")
    return made


def _loss_scaled(inner, options):
    if options.precision == "mixed_float16":  # scales the loss so float16 gradients neither vanish nor overflow
        return keras.optimizers.LossScaleOptimizer(inner)
    if options.nan_policy == "skip":
        # Keras' loss-scale optimizer is what skips non-finite steps. Its scale starts at 1, halves
        # on a skipped step (the engine puts it back to 1 after every call) and never grows; powers
        # of two scale float32 exactly.
        return keras.optimizers.LossScaleOptimizer(inner, initial_scale=1.0, dynamic_growth_steps=2**31 - 1)
    return inner
