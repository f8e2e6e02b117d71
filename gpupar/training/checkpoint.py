"""Checkpoints of model, optimizer and position (epoch, step), and resuming from them."""

import dataclasses
import json
import logging
import os
from typing import Mapping, Optional

import keras
import tensorflow as tf

from gpupar import keras_compat
from gpupar.errors import GpuparError

log = logging.getLogger("gpupar")
WITHIN_EPOCH = "within_epoch"


@dataclasses.dataclass(frozen=True)
class Position:
    """Where training stands: `epoch` epochs complete, plus `step` steps of the next one.

    `global_batch` is the batch those steps had (0 where unknown: nothing restored yet);
    `totals` the sums of those steps (gpupar.training.loop.EpochTotals as a dict), so that the record of
    an epoch resumed in its middle covers the whole epoch.
    """

    epoch: int = 0
    step: int = 0
    global_batch: int = 0
    totals: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def rebatched(self, global_batch: int, steps_per_epoch: int) -> "Position":
        """The same point for a run with another global batch or epoch length.

        Mid-epoch, the examples already seen decide the step; the data order from there on is
        then not the one an uninterrupted run would have seen.
        """
        step = self.step
        if step and self.global_batch and self.global_batch != global_batch:
            step = step * self.global_batch // global_batch
        return Position(self.epoch, min(step, steps_per_epoch - 1) if step else 0, global_batch,
                        self.totals if step else {})


class Checkpoints:
    """Writes ckpt-N after epoch N into model_dir, and step checkpoints within an epoch.

    Step checkpoints (for checkpoint_every_steps and interruptions) go to model_dir/within_epoch,
    which keeps only the newest. Each save writes its files first and then atomically replaces
    the small index file that names the latest one, so a process killed at any moment leaves the
    previous checkpoint readable. A checkpoint stores one copy of each variable, so one written
    with N replicas restores into any other replica count. It also names the model that wrote it
    (`signature`: the model and its shape-defining options), so that restoring into another model
    says which one the checkpoint needs. With save=False it only restores. A loss-scale
    optimizer's scale and its count of good steps (mixed_float16) go in too: a resumed run starts
    from the scale it had reached, not from 2^15 again with overflowing first steps. `state` names
    what the run trains ({"model": ..., "optimizer": ..., and the step's own state, "step_state",
    such as its metrics}: gpupar.training.trainer.Trainer.state); the model's random state
    (Keras' SeedGenerators) goes in beside it. What a bit-for-bit resume needs besides the
    variables' values (ExactResumeState) goes in too, and is put back where a checkpoint has it.
    """

    def __init__(self, model_dir: Optional[str], state: Mapping, max_to_keep: Optional[int] = None,
                 global_batch: int = 0, signature: Optional[Mapping] = None, save: bool = True,
                 loss_scale_optimizer=None):
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step_in_epoch")
        self.global_batch = tf.Variable(global_batch, dtype=tf.int64, trainable=False, name="global_batch")
        self.totals = tf.Variable("{}", dtype=tf.string, trainable=False, name="epoch_totals")
        self.signature = dict(signature or {})
        self.scaled = loss_scale_optimizer
        self.loss_scale = tf.Variable([0.0, 0.0], dtype=tf.float32, trainable=False, name="loss_scale")
        self.run_global_batch = global_batch
        held = dict(
            **state, epoch=self.epoch, step=self.step, global_batch=self.global_batch,
            epoch_totals=self.totals, loss_scale=self.loss_scale, random_state=model_random_state(state["model"]),
            model_signature=tf.Variable(json.dumps(self.signature, sort_keys=True), dtype=tf.string, trainable=False))
        self.exact = ExactResumeState(state.get("step_state", ()))
        self.checkpoint = tf.train.Checkpoint(**held, **self.exact.variables)
        self.required = tf.train.Checkpoint(**held)  # what a restore must find (checkpoints before `exact` lack it)
        self.model_dir, self.saving = model_dir, save
        self.epochs = self.steps = None
        if model_dir is not None:
            self._managers(model_dir, max_to_keep)
        self.latest = None

    def _managers(self, directory: str, max_to_keep: Optional[int]):
        self.epochs = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep=max_to_keep)
        self.steps = tf.train.CheckpointManager(
            self.checkpoint, os.path.join(directory, WITHIN_EPOCH), max_to_keep=1, checkpoint_name="step"
        )

    def write_to(self, directory: str):
        """Saves into `directory` from now on (a non-chief worker's scratch folder, after restoring)."""
        self._managers(directory, 1)
        self.saving = True

    @staticmethod
    def _unreadable(path, error):
        return GpuparError(
            f"{path}: cannot restore this checkpoint into the model ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}); it was written by another model or is damaged. "
            "Nothing was changed on disk; resume from an older checkpoint or use a new model_dir"
        )

    def _position_in(self, path) -> tuple:
        """(epoch, step) stored in a checkpoint, read without restoring it."""
        try:
            reader = tf.train.load_checkpoint(path)
            return tuple(int(reader.get_tensor(f"{name}/.ATTRIBUTES/VARIABLE_VALUE")) for name in ("epoch", "step"))
        except (IndexError, ValueError, tf.errors.OpError) as e:
            raise self._unreadable(path, e) from None

    def _check_signature(self, path):
        """Refuses a checkpoint written by another model, naming the model it needs."""
        try:
            saved = tf.train.load_checkpoint(path).get_tensor("model_signature/.ATTRIBUTES/VARIABLE_VALUE")
        except (IndexError, ValueError, tf.errors.OpError):
            return  # damaged (restore says so), or written before checkpoints named their model
        saved = json.loads(saved.decode() if isinstance(saved, bytes) else saved)
        if self.signature and saved != self.signature:
            raise GpuparError(
                f"{path} was written by {describe_signature(saved)}, but this run builds "
                f"{describe_signature(self.signature)}; resume with the options of the checkpoint's model "
                "(or another model_dir for this one). Nothing was changed on disk"
            )

    def restore(self, resume) -> Position:
        """Restores per `resume` (False, True for the one further along in model_dir, or a path)."""
        if resume is False:
            return Position()
        if isinstance(resume, str):
            path = resume
        else:
            candidates = [m.latest_checkpoint for m in (self.epochs, self.steps) if m and m.latest_checkpoint]
            if not candidates:
                if self.model_dir is None:
                    log.warning("resume: no earlier run to resume, so this run starts from scratch")
                else:
                    log.warning("resume: no checkpoint in %s yet, so this run starts from scratch", self.model_dir)
                return Position()
            path = max(candidates, key=self._position_in)
        self._check_signature(path)
        try:
            # What the exact state holds is read apart (put_back): not left unmatched, nor warned of at exit.
            self.required.restore(path).assert_existing_objects_matched().expect_partial()
            self.exact.put_back(tf.train.load_checkpoint(path))
        except (AssertionError, IndexError, ValueError, tf.errors.OpError) as e:
            raise self._unreadable(path, e) from None
        scale, good_steps = (float(v) for v in self.loss_scale.numpy())
        if self.scaled is not None and scale > 0:
            self.scaled.dynamic_scale.assign(scale)
            self.scaled.step_counter.assign(int(good_steps))
        totals = json.loads(self.totals.numpy().decode() or "{}")
        position = Position(int(self.epoch.numpy()), int(self.step.numpy()), int(self.global_batch.numpy()), totals)
        self.latest = path
        log.info("resumed from %s after %d epoch(s) and %d step(s)", path, position.epoch, position.step)
        return position

    def _save(self, manager, number, position: Position) -> Optional[str]:
        if manager is None or not self.saving:
            return None
        self.epoch.assign(position.epoch)
        self.step.assign(position.step)
        self.global_batch.assign(self.run_global_batch)
        self.totals.assign(json.dumps(dict(position.totals)))
        if self.scaled is not None:
            self.loss_scale.assign([float(self.scaled.dynamic_scale.numpy()), float(self.scaled.step_counter.numpy())])
        self.exact.record()
        try:
            self.latest = manager.save(checkpoint_number=number)
        except (OSError, tf.errors.OpError) as e:
            intact = (f"the last complete checkpoint {self.latest} is intact" if self.latest
                      else "no checkpoint was written before")
            raise GpuparError(
                f"could not write a checkpoint into {manager.directory} ({type(e).__name__}: "
                f"{str(e).splitlines()[0]}); {intact}. Free space or fix permissions, then resume"
            ) from None
        return self.latest

    def save_epoch(self, epochs_done: int) -> Optional[str]:
        """Writes ckpt-<epochs_done>; returns its path, or None when this run saves nothing."""
        return self._save(self.epochs, epochs_done, Position(epochs_done, 0))

    def save_step(self, position: Position, global_step: int) -> Optional[str]:
        """Writes a within-epoch checkpoint at `position` (its totals included); returns its path."""
        return self._save(self.steps, global_step, position)


class ExactResumeState:
    """What a resumed run needs besides the variables' values to go on bit for bit as an uninterrupted run.

    - Each replica's own value of the step's sync-on-read variables (a model's own train_step's
      metrics). TensorFlow saves such a variable as its replicas' sum and restores 1/N of it on
      each, so the logs of a resumed epoch (each replica's result(), averaged) would differ from
      an uninterrupted run's in their last bits. Put back onto the same number of replicas of one
      process; elsewhere TensorFlow's split stays.
    - The state of TensorFlow's global generator (tf.random.get_global_generator()), where one
      exists; a tf.random.Generator kept on the model is in the model's part already.

    Both are held as serialized tensors in string variables, and read from a checkpoint only where
    it has them.
    """

    def __init__(self, step_state=()):
        self.step_state = [v.value if isinstance(v, keras.Variable) else v for v in step_state]
        self.by_replica = tf.Variable([b""] * len(self.step_state), dtype=tf.string, trainable=False,
                                      name="step_state_by_replica")
        self.generator = tf.Variable(b"", dtype=tf.string, trainable=False, name="global_generator_state")
        self.variables = {"step_state_by_replica": self.by_replica, "global_generator_state": self.generator}

    def record(self):
        """Copies the current values into the string variables, before a save."""
        self.by_replica.assign(tf.constant([
            tf.io.serialize_tensor(tf.stack([c.read_value() for c in v.values])).numpy() if _per_replica(v) else b""
            for v in self.step_state], dtype=tf.string, shape=[len(self.step_state)]))
        generator = _global_generator()
        self.generator.assign(tf.io.serialize_tensor(generator.state.read_value()) if generator is not None else b"")

    def put_back(self, reader):
        """Puts the values that the checkpoint `reader` reads back where they fit."""
        names = reader.get_variable_to_dtype_map()
        if _key("step_state_by_replica") in names:
            for v, saved in zip(self.step_state, reader.get_tensor(_key("step_state_by_replica"))):
                if saved and _per_replica(v):
                    values = tf.io.parse_tensor(saved, v.dtype)
                    if values.shape[0] == len(v.values):
                        for component, value in zip(v.values, values):
                            component.assign(value)
        generator = _global_generator()
        saved = reader.get_tensor(_key("global_generator_state")) if _key("global_generator_state") in names else b""
        if saved and generator is not None:
            state = tf.io.parse_tensor(saved, generator.state.dtype)
            if state.shape == generator.state.shape:
                generator.state.assign(state)


# Random ops whose state lives in the op's kernel, where no checkpoint reaches it: op type -> the call that makes it.
_KERNEL_STATE_DRAWS = {
    "RandomStandardNormal": "tf.random.normal", "RandomUniform": "tf.random.uniform",
    "RandomUniformInt": "tf.random.uniform", "TruncatedNormal": "tf.random.truncated_normal",
    "ParameterizedTruncatedNormal": "tf.random.truncated_normal", "RandomShuffle": "tf.random.shuffle",
    "Multinomial": "tf.random.categorical", "RandomGamma": "tf.random.gamma", "RandomPoisson": "tf.random.poisson",
    "RandomPoissonV2": "tf.random.poisson",
}


def unsaved_draws(graph) -> list:
    """The calls (tf.random.normal, ...) that make random ops in a traced graph whose state no checkpoint holds.

    Such an op, seeded or not, draws from where its kernel has got to in this process: a resumed
    run starts it from the beginning again, whatever the checkpoint holds.
    """
    graph_def = graph.as_graph_def()
    ops = [node.op for node in graph_def.node]
    ops += [node.op for function in graph_def.library.function for node in function.node_def]
    return sorted({_KERNEL_STATE_DRAWS[op] for op in ops if op in _KERNEL_STATE_DRAWS})


def inexact_resume_note(step: str, draws) -> str:
    """The log line that says a resumed run will not draw what an uninterrupted one would, and what to draw with."""
    return (f"resume: {step} draws with {', '.join(draws)}, whose state no checkpoint can hold, so a resumed run will "
            "not draw what an uninterrupted one would; for an exact resume draw with keras.random.* and a "
            "keras.random.SeedGenerator kept on the model (or a tf.random.Generator kept on it)")


def _key(name: str) -> str:
    """The name a checkpoint gives the value of the variable `name` held at its root."""
    return f"{name}/.ATTRIBUTES/VARIABLE_VALUE"


def _per_replica(variable) -> bool:
    """Whether the variable keeps a value per replica that a checkpoint sums: sync-on-read, every replica here."""
    return (isinstance(variable, tf.distribute.DistributedValues)
            and variable.synchronization == tf.VariableSynchronization.ON_READ
            and 1 < len(variable.values) == variable.distribute_strategy.num_replicas_in_sync)


def _global_generator():
    """TensorFlow's global generator if one exists, else None (keras_compat.tf_global_generator)."""
    return keras_compat.tf_global_generator()


def model_random_state(model) -> list:
    """The model's random state: its variables that are not weights (Keras: the SeedGenerators' states)."""
    weights = {id(w) for w in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def describe_signature(signature: Mapping) -> str:
    """'model lstm (lstm_layers=2, lstm_units=64)' from a checkpoint's model signature."""
    options = ", ".join(f"{k}={v}" for k, v in sorted(signature.items()) if k != "model")
    return f"model {signature.get('model', '?')}" + (f" ({options})" if options else "")


class ModelDirLock:
    """Holds an exclusive lock on model_dir for one run, so two runs never write it at once.

    The lock is an flock on model_dir/.gpupar.lock: the operating system drops it when the
    process dies, even by SIGKILL, so a crashed run never blocks the next one.
    """

    def __init__(self, model_dir: Optional[str]):
        self.model_dir = model_dir
        self.file = None

    def __enter__(self):
        if self.model_dir is None:
            return self
        import fcntl

        path = os.path.join(self.model_dir, ".gpupar.lock")
        try:
            os.makedirs(self.model_dir, exist_ok=True)
            self.file = open(path, "a+")
        except OSError as e:
            raise GpuparError(
                f"model_dir={self.model_dir!r} cannot be written ({e.strerror}); choose a folder you "
                "can write, or fix its permissions"
            ) from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.seek(0)
            owner = self.file.read().strip() or "unknown"
            self.file.close()
            raise GpuparError(
                f"model_dir={self.model_dir!r} is in use by another gpupar run (pid {owner}); wait for "
                "it to finish or use another model_dir"
            ) from None
        self.file.truncate(0)
        self.file.write(str(os.getpid()))
        self.file.flush()
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()
        return False
