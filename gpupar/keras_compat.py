"""Every read or patch of Keras' and TensorFlow's private code, in one place.

gpupar builds on Keras: Keras' own compile, losses, metrics, callbacks and train_step do the
work, and gpupar changes only what a strategy gets wrong. Where Keras offers no public hook for
that, the one private touch is here, each with the source it reads or works around and the
versions it was checked on: Keras 3.8, 3.10, 3.12 and 3.15 with TensorFlow 2.18 to 2.21, the
range pyproject.toml admits (tests/test_keras_compat.py holds each one on the installed pair,
and `make test-versions` runs it on every pair). Nothing here changes Keras for the rest of the
process: the two replacements of a Keras function (`per_replica_semantics`) are made only while
a gpupar step function is being called, and act only in the threads that run its replicas.
"""

import contextlib
import threading

import keras
import tensorflow as tf

# -- A compiled model's parts (keras/src/trainers/trainer.py, Trainer.compile) -------------------


def compile_loss(model):
    """The model's CompileLoss (Keras' resolution of compile's loss, loss_weights and outputs), or None.

    Trainer.compile keeps it as `_compile_loss` (3.0-3.15); Trainer.compute_loss calls it, and
    gpupar calls it the same way (y, y_pred, sample_weight), without compute_loss's read of
    `model.losses`, which under MirroredStrategy may hold another replica's losses by then.
    """
    return getattr(model, "_compile_loss", None)


def loss_tracker(model):
    """The keras.metrics.Mean that logs a compiled model's "loss" (`_loss_tracker`, 3.0-3.15), or None.

    Keras' train_step updates it with the step's loss and the batch's rows; gpupar's step does
    the same with the global batch's loss (gpupar.training.loss.track_loss).
    """
    return getattr(model, "_loss_tracker", None)


def compile_metrics(model):
    """The model's CompileMetrics (compile's metrics and weighted_metrics, resolved), or None.

    Trainer.compile keeps it as `_compile_metrics` (3.0-3.15); Trainer.compute_metrics updates it.
    """
    return getattr(model, "_compile_metrics", None)


def compile_settings(model) -> dict:
    """compile()'s arguments as the user gave them (metric objects as objects): `_compile_config.config`.

    get_compile_config() returns them serialized; gpupar needs the objects themselves to compile
    a rebuilt copy of the model with fresh metrics (3.0-3.15).
    """
    config = getattr(model, "_compile_config", None)
    return dict(config.config) if config is not None else {}


def strategy_of(model):
    """The tf.distribute.Strategy whose scope the model was made in, None outside any.

    keras/src/backend/tensorflow/trainer.py (TensorFlowTrainer.__init__) keeps it as
    `_distribute_strategy` (3.0-3.15).
    """
    return getattr(model, "_distribute_strategy", None)


def initial_epoch(model):
    """The epoch a callback asked training to start from in its on_train_begin, or None.

    Keras' callbacks (BackupAndRestore) set the model's `_initial_epoch`, which Keras' fit reads
    after on_train_begin (keras/src/backend/tensorflow/trainer.py, 3.0-3.15).
    """
    return getattr(model, "_initial_epoch", None)


def all_layers(model, include_self: bool = True) -> list:
    """The model's layers, nested ones included: Layer._flatten_layers (3.0-3.15; `model.layers` is one level)."""
    return list(model._flatten_layers(include_self=include_self))


def symbolic_build(model, data_batch):
    """Builds what Keras' fit builds before its first step, from one batch's shapes and dtypes, symbolically.

    Trainer._symbolic_build (keras/src/trainers/trainer.py, 3.0-3.15): a model without an Input
    (its layers are built on a symbolic call), the compiled metrics and the CompileLoss (their
    variables, and what callbacks read, such as a metric's direction for EarlyStopping). Keras'
    fit does this under a strategy, as gpupar does (call it in the strategy's scope): inside a
    replica's step the variables could not be made. Keras' build of the optimizer is left out,
    to the caller: gpupar builds it on the variables it updates (the shards of a split variable).
    """
    if not model.built and type(model).call is keras.Model.call:  # no call of its own (a GAN): none to build
        if not all(layer.built for layer in all_layers(model, include_self=False)):
            return  # its own train_step builds its layers when first traced, as Keras' fit does without a strategy
        model.built = True
    data_batch = tf.nest.map_structure(lambda t: t if t is None or tf.is_tensor(t) else tf.convert_to_tensor(t),
                                       data_batch)
    optimizer, model.optimizer = model.optimizer, None
    try:
        model._symbolic_build(data_batch=data_batch)
    finally:
        model.optimizer = optimizer


def compiled_losses(model) -> list:
    """(path, keras.losses.Loss) of each loss the model's built CompileLoss resolved, one per output with a loss.

    CompileLoss keeps them in `_flat_losses`, namedtuples (path, loss, loss_weights, name)
    (keras/src/trainers/compile_utils.py, 3.8-3.15); the path says where the output's labels and
    outputs are in theirs. [] before it is built (symbolic_build).
    """
    compiled = compile_loss(model)
    if compiled is None or not compiled.built:
        return []
    return [(tuple(entry.path), entry.loss) for entry in compiled._flat_losses]


@contextlib.contextmanager
def compile_losses_replaced(model, replace):
    """While open, each loss of the model's CompileLoss is replace(loss, path, loss_weight) instead.

    CompileLoss keeps its resolved losses in `_flat_losses`, namedtuples (path, loss,
    loss_weights, name) (keras/src/trainers/compile_utils.py, 3.8-3.15), and calls each one as
    loss(y_true, y_pred, sample_weight); the originals are put back when the block ends.
    """
    compiled = compile_loss(model)
    original = list(compiled._flat_losses) if compiled is not None and compiled.built else []
    try:
        if original:
            compiled._flat_losses = [entry._replace(loss=replace(entry.loss, entry.path, entry.loss_weights))
                                     for entry in original]
        yield
    finally:
        if original:
            compiled._flat_losses = original


# -- One keras.losses.Loss, reduced by the caller (keras/src/losses/loss.py) -----------------------


def loss_sums(loss, y_true, y_pred, sample_weight=None):
    """(the loss's weighted, masked sum on this batch, the count its reduction divides that sum by, whether its
    call gives one value for the whole batch).

    Loss.__call__'s own steps (keras/src/losses/loss.py, the same in 3.8-3.15), stopped before
    it divides: the mask of the outputs and the one `call` sets on its values (ignore_class)
    merged, the values and sample weights brought to the same rank, and summed by Keras'
    reduce_weighted_values with reduction "sum". The count is what the loss's reduction divides
    by on one device: the number of unmasked values ("sum_over_batch_size", "mean"), or the sum of
    the masked sample weights ("mean_with_sample_weight"); a loss of one value per batch counts
    one. For "sum" the count is not used.
    """
    from keras.src.backend import get_keras_mask
    from keras.src.losses.loss import reduce_weighted_values

    in_mask = get_keras_mask(y_pred)
    with tf.name_scope(loss.name):
        y_pred = tf.nest.map_structure(lambda t: keras.ops.convert_to_tensor(t, dtype=loss.dtype), y_pred)
        y_true = tf.nest.map_structure(lambda t: keras.ops.convert_to_tensor(t, dtype=loss.dtype), y_true)
        values = loss.call(y_true, y_pred)
        out_mask = get_keras_mask(values)
        values = keras.ops.convert_to_tensor(values, dtype=loss.dtype)  # a function may return a Python number
        masks = [m for m in (in_mask, out_mask) if m is not None]
        mask = None if not masks else masks[0] if len(masks) == 1 else masks[0] & masks[1]
        total = reduce_weighted_values(values, sample_weight=sample_weight, mask=mask, reduction="sum",
                                       dtype=loss.dtype)
        counted = sample_weight if loss.reduction == "mean_with_sample_weight" else None
        count = reduce_weighted_values(keras.ops.ones_like(values), sample_weight=counted, mask=mask,
                                       reduction="sum", dtype=loss.dtype)
    # Keras returns values of shape (0,) as they are (reduce_values): an empty share (a replica of a last
    # small batch, run eagerly) sums to 0.
    return keras.ops.sum(total), keras.ops.sum(count), values.shape.rank == 0


# -- Per-replica semantics: a Keras loss inside the model, and random draws --------------------------

_IN_REPLICA = threading.local()  # what this thread, a gpupar replica's, asks of Keras while it calls the model
_PATCHED = {"depth": 0}
_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def in_replica(undivided_losses: bool = True):
    """Marks this thread as a gpupar replica's while the block runs (see per_replica_semantics).

    Its random draws differ from the other replicas'; with undivided_losses, a Keras loss
    object called inside the block does not divide by the replica count (gpupar's own step,
    which divides the model's added losses itself); a model's own train_step keeps Keras' division.
    """
    before = (getattr(_IN_REPLICA, "draws", False), getattr(_IN_REPLICA, "losses", False))
    _IN_REPLICA.draws, _IN_REPLICA.losses = True, undivided_losses
    shared = _SHARED_GENERATOR.get("generator")
    if shared is not None and global_seed_generator() is None:
        set_global_seed_generator(shared)  # a replica's thread: Keras would make one inside the traced step
    try:
        yield
    finally:
        _IN_REPLICA.draws, _IN_REPLICA.losses = before


@contextlib.contextmanager
def per_replica_semantics():
    """While open, two Keras functions act per replica inside gpupar's calls (in_replica), and as Keras' elsewhere.

    - keras.src.losses.loss.scale_loss_for_distribution (3.0-3.15) divides a Keras Loss's value by
      the strategy's replica count as the Loss reduces it. Inside the model (add_loss of a
      loss object, keras-io's endpoint layer) that value is then divided again by Keras' own
      aggregation of added losses (TensorFlowTrainer._aggregate_additional_loss), so model.fit
      under a strategy halves it on two replicas; gpupar divides every added loss once, so there
      it is left as it is. Keras looks the function up in its module each time it runs.
    - keras.src.random.seed_generator.SeedGenerator.next (3.0-3.15) gives every replica the same
      seed: a SeedGenerator's state is one variable with the same value on every replica, so
      under MirroredStrategy every replica's Dropout drops the same units of its own examples.
      Inside gpupar's model call a seed drawn in a replica context of several replicas has the
      replica's index added, so replicas draw apart, while the state advances as Keras' does (a
      resumed run draws what an uninterrupted one would).
    gpupar enters this around each call of its step functions, where they are traced; it is
    reentrant and thread-safe, and puts Keras' functions back when the outermost block ends.
    """
    from keras.src.losses import loss as keras_loss
    from keras.src.random.seed_generator import SeedGenerator

    with _PATCH_LOCK:
        if _PATCHED["depth"] == 0:
            scale, draw = keras_loss.scale_loss_for_distribution, SeedGenerator.next
            _PATCHED.update(scale=scale, draw=draw)

            def scale_outside_replicas(value):
                return value if getattr(_IN_REPLICA, "losses", False) else scale(value)

            def next_on_this_replica(generator, ordered=True):
                seed = draw(generator, ordered=ordered)
                context = tf.distribute.get_replica_context()
                if not getattr(_IN_REPLICA, "draws", False) or context is None or context.num_replicas_in_sync == 1:
                    return seed
                replica = tf.cast(context.replica_id_in_sync_group, seed.dtype)
                return seed + tf.stack([replica * tf.cast(7919, seed.dtype), tf.zeros_like(replica)])

            keras_loss.scale_loss_for_distribution = scale_outside_replicas
            SeedGenerator.next = next_on_this_replica
        _PATCHED["depth"] += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCHED["depth"] -= 1
            if _PATCHED["depth"] == 0:
                keras_loss.scale_loss_for_distribution = _PATCHED.pop("scale")
                SeedGenerator.next = _PATCHED.pop("draw")


_GLOBAL_SEED_GENERATOR = "global_seed_generator"  # the global_state key (3.15 names it GLOBAL_SEED_GENERATOR)
_SHARED_GENERATOR = {}  # the global SeedGenerator that every replica's thread shares (share_global_seed_generator)


def global_seed_generator():
    """This thread's Keras global SeedGenerator (unseeded keras.random draws), or None where none is made yet.

    Keras keeps it in keras.src.backend.common.global_state, a threading.local, under the key
    "global_seed_generator" (keras/src/random/seed_generator.py, 3.0-3.15).
    """
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute(_GLOBAL_SEED_GENERATOR)


def set_global_seed_generator(generator):
    """Makes `generator` this thread's Keras global SeedGenerator (see global_seed_generator)."""
    from keras.src.backend.common import global_state

    global_state.set_global_attribute(_GLOBAL_SEED_GENERATOR, generator)


def share_global_seed_generator(generator):
    """Makes `generator` this thread's global SeedGenerator, and that of every replica's thread (in_replica).

    MirroredStrategy runs each replica in a thread of its own, where Keras would make another
    generator inside the traced step on the first unseeded draw, which TensorFlow refuses.
    """
    set_global_seed_generator(generator)
    _SHARED_GENERATOR["generator"] = generator


def remake_variable(variable):
    """Makes a Keras variable's TensorFlow variable again, with its value, under the current scope and device.

    A Keras variable keeps its TensorFlow variable in `_value`, which its own `_initialize` makes
    from a value with the variable's name, dtype, trainability, aggregation and synchronization
    (keras/src/backend/tensorflow/core.py, Variable._initialize, 3.0-3.15). Layers hold the Keras
    variable objects, so they then use the new one.
    """
    variable._initialize(tf.identity(variable.value))


def move_variables(model, strategy):
    """Makes each of the model's variables again under `strategy`'s scope, with its value: as if built there.

    Each variable is made again in the scope (remake_variable), so the same model object then
    trains under the strategy, and belongs to it as one made in its scope does
    (TensorFlowTrainer's `_distribute_strategy`, see strategy_of, 3.0-3.15). Its traced
    functions of an earlier Keras fit, made on the old variables, are dropped (TensorFlowTrainer's
    train_function, test_function, predict_function: Keras makes them again). Call it in the
    strategy's scope.
    """
    seen = set()
    for variable in [*model.variables, *model.metrics_variables]:
        if id(variable) not in seen and variable_strategy(variable) is not strategy:
            remake_variable(variable)
        seen.add(id(variable))
    for layer in all_layers(model):
        if isinstance(layer, keras.Model):
            layer.train_function = layer.test_function = layer.predict_function = None
    model._distribute_strategy = strategy  # Keras' evaluate and predict then run under it, as for a model made there


@contextlib.contextmanager
def optimizers_built_outside(optimizers, strategy):
    """While open, an optimizer that builds itself inside a traced step makes its variables outside it.

    A Keras optimizer makes its variables on its first apply_gradients (BaseOptimizer.apply,
    keras/src/optimizers/base_optimizer.py, 3.0-3.15), with the variables it is given; inside
    a tf.function under MirroredStrategy those cannot be made (their initial values would depend
    on the function's inputs), which is why Keras' own fit fails on a GAN under a strategy. So
    each unbuilt optimizer's `build` is, on this object only and while the block lasts, run
    eagerly in the strategy's scope on the same variables, as if it had been built before the step.
    """
    patched = [optimizer for optimizer in optimizers if not optimizer.built]
    for optimizer in patched:
        def build(variables, build=optimizer.build):
            def eagerly(*_):
                with tf.init_scope(), strategy.scope():
                    build(variables)
            context = tf.distribute.get_replica_context()
            context.merge_call(eagerly) if context is not None else eagerly()
        optimizer.__dict__["build"] = build
    try:
        yield
    finally:
        for optimizer in patched:
            optimizer.__dict__.pop("build", None)


def variable_strategy(variable):
    """The strategy a Keras variable's TensorFlow variable was made under (`_distribute_strategy`), or None."""
    return getattr(getattr(variable, "value", None), "_distribute_strategy", None)


# -- TensorFlow's own internals --------------------------------------------------------------------------------------


def tf_global_generator():
    """TensorFlow's global tf.random.Generator if one exists, else None (stateful_random_ops.global_generator).

    Not tf.random.get_global_generator(), which would make one here, outside the strategy's scope,
    where a step under the strategy could not draw from it (tensorflow/python/ops/stateful_random_ops.py,
    TF 2.18-2.21).
    """
    from tensorflow.python.ops import stateful_random_ops

    return stateful_random_ops.global_generator


def gpu_descriptions() -> list:
    """TensorFlow's description of each GPU of the started runtime (its PCI bus id among them).

    tf.config's public device details give no bus id: this is device_lib.list_local_devices
    (tensorflow/python/client/device_lib.py, TF 2.18-2.21), given the runtime's own config
    (tensorflow/python/eager/context.py, context().config), so that it makes the GPUs as configured.
    """
    from tensorflow.python.client import device_lib
    from tensorflow.python.eager import context

    return [d.physical_device_desc for d in device_lib.list_local_devices(context.context().config)
            if d.device_type == "GPU"]


def saved_as_shards(variable):
    """Makes a Keras variable that holds a tf.distribute ShardedVariable save and restore as the ShardedVariable does.

    TensorFlow saves a ShardedVariable in slices of one tensor (which an unsplit variable
    restores too) through its _gather_saveables_for_checkpoint; Keras' variable saves its own
    value as one tensor. The variable's class is swapped, on this object only, for a subclass
    that hands the checkpoint the ShardedVariable's saveables (Trackable's
    _gather_saveables_for_checkpoint, TF 2.18-2.21; Keras 3.8-3.15's Variable is a Trackable).
    """
    variable.__class__ = _sharded_class(type(variable))


def _sharded_class(keras_class):
    """keras_class, saving as the ShardedVariable it holds."""
    if getattr(keras_class, "holds_shards", False):
        return keras_class

    class ShardedKerasVariable(keras_class):
        holds_shards = True

        def _gather_saveables_for_checkpoint(self):
            return self.value._gather_saveables_for_checkpoint()

    return ShardedKerasVariable


def tensor_spec_of(batches):
    """The tf.TypeSpec of a generator's or PyDataset's batches, as Keras' own adapters read it from some of them.

    keras/src/trainers/data_adapters/data_adapter_utils.get_tensor_spec (3.0-3.15): the spec of
    the first batches, the batch dimension and any dimension that differs left unknown.
    """
    from keras.src.trainers.data_adapters.data_adapter_utils import get_tensor_spec

    return get_tensor_spec(batches)
