"""One training run from a Config: the mode, output folders, locks, restore, the observers, the loop, the result.

gpupar.fit and gpupar.fit_mnist come here with their Config and Task (gpupar.training.task).
In a synchronous cluster every worker runs the same loop and only the chief keeps what it writes
(gpupar.training.multi_worker); with parameter servers the chief coordinates and the other
tasks serve (gpupar.training.modes.parameter_server).
"""

import contextlib
import logging
import sys
import time

import tensorflow as tf

from gpupar.config import AUTO, Config
from gpupar.data.adapters import input_errors
from gpupar.monitor import utilisation
from gpupar.runtime.cluster import detect_cluster
from gpupar.training import multi_worker
from gpupar.training.checkpoint import Checkpoints, ModelDirLock, Position
from gpupar.training.interrupt import StopRequests
from gpupar.training.loop import Loop
from gpupar.training.observers import (GpuUse, InputWaitMonitor, KerasCallbacks, MetricsFile, Observers, Profile,
                                       ProgressLog, StepsPerCallTuner, TensorBoardScalars)
from gpupar.training.outputs import describe_outputs, left_clean_on_error, resolve_outputs
from gpupar.training.result import FitResult, format_logs
from gpupar.training.setup import build_trainer
from gpupar.training.task import Task

log = logging.getLogger("gpupar")


def train_and_evaluate(config: Config, task: Task, mode) -> FitResult:
    """Trains `task` as the config says, evaluating and checkpointing after every epoch.

    Args:
      config: The run's options.
      task: What to train (gpupar.training.task: gpupar.fit's arguments, or an MNIST preset).
      mode: The run's mode (gpupar.training.modes.checked: its options' refusals done).

    Returns:
      The FitResult: the model, its history and final logs.

    Raises:
      GpuparError: a bad option or input (before any step, nothing written), a failed save, a
        non-finite loss (the last good checkpoint is kept), a cluster that broke.
      TrainingInterrupted: SIGINT or SIGTERM, after a checkpoint.
    """
    # verbose=0: gpupar's log says only warnings and errors while the run lasts, as model.fit prints nothing.
    with log_level(logging.WARNING if config.loop.verbose == 0 else None):
        return _train(config, task, mode)


@contextlib.contextmanager
def log_level(level):
    """gpupar's log at `level` while the block runs (as it is where level is None)."""
    before = log.level
    if level is not None:
        log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(before)


def _train(config: Config, task: Task, mode) -> FitResult:
    cluster = detect_cluster(slurm_ps=config.distribution.slurm_ps)
    chief = cluster is None or cluster.is_chief
    outputs = resolve_outputs(config.outputs, chief=chief)
    if mode.serves(cluster):
        mode.serve(config.device_setup, cluster)  # never returns
    started = time.perf_counter()
    trainer = build_trainer(config, task, mode, cluster)  # every check of the input first: nothing is written before
    with contextlib.ExitStack() as held:
        held.enter_context(left_clean_on_error(outputs.model_dir if chief and outputs.save else None))
        held.enter_context(ModelDirLock(outputs.model_dir if chief and outputs.save else None))
        stop = held.enter_context(StopRequests())
        scratch = None
        if cluster is not None:
            # TF's coordination service took SIGTERM over when the strategy started.
            stop.reinstall()
            if trainer.placement.lockstep_workers:
                scratch = held.enter_context(multi_worker.ScratchDir(cluster, outputs.model_dir, outputs.save)).path
                outputs = multi_worker.worker_outputs(outputs, cluster)
                stop = multi_worker.AgreedStop(stop, trainer.strategy)  # every worker stops after the same step
        return Run(config, task, trainer, outputs, cluster, stop, scratch, started).train()


class Run:
    """One run from its restore to its result: what the loop drives, and everything around it (Orbit's Controller).

    It owns the run's state from start to exit: the Trainer, its outputs, the cluster, the stop
    requests, a non-chief worker's scratch folder, the checkpoints, the position training starts
    at and the observers. `train()` restores, runs the loop, and writes and exports the result.

    Attributes:
      config: The run's options.
      task: What it trains.
      trainer: The Trainer (gpupar.training.setup.build_trainer).
      outputs: Where it writes (gpupar.training.outputs), a worker's own in a synchronous cluster.
      cluster: The cluster, or None.
      stop: The stop requests (gpupar.training.interrupt.StopRequests, or a cluster's agreed stop).
      scratch_dir: Where a non-chief worker of a synchronous cluster writes what it must and keeps nothing, or None.
      started: time.perf_counter() when the run began, for its total time.
      checkpoints: Its Checkpoints.
    """

    def __init__(self, config: Config, task: Task, trainer, outputs, cluster, stop, scratch_dir, started: float):
        self.config, self.task, self.trainer, self.outputs = config, task, trainer, outputs
        self.cluster, self.stop, self.scratch_dir, self.started = cluster, stop, scratch_dir, started
        self.checkpoints = Checkpoints(outputs.model_dir, trainer.state(), outputs.max_to_keep, trainer.global_batch,
                                       trainer.signature, outputs.save, trainer.loss_scale)
        self.start = Position()

    def restore(self) -> Position:
        """Restores the latest checkpoint (as outputs.resume says); the position training starts at."""
        trainer, outputs = self.trainer, self.outputs
        saved_at = self.checkpoints.restore(outputs.resume)
        if self.scratch_dir is not None:
            self.checkpoints.write_to(self.scratch_dir)  # a non-chief worker: it restores the chief's, keeps nothing
        start = saved_at.rebatched(trainer.global_batch, trainer.steps_per_epoch)
        if (start.epoch, start.step) == (0, 0) and self.config.loop.initial_epoch:
            start = Position(self.config.loop.initial_epoch)  # model.fit's initial_epoch, where no checkpoint says else
        if start.step != saved_at.step:
            log.info("the checkpoint is %d steps of %d into epoch %d; with %d steps of %d per epoch now, this run "
                     "continues at step %d, on a data order of its own", saved_at.step, saved_at.global_batch,
                     saved_at.epoch, trainer.steps_per_epoch, trainer.global_batch, start.step)
        if trainer.learning_rate is not None:
            trainer.optimizer.learning_rate.assign(trainer.learning_rate)  # the checkpoint's value would win otherwise
        return start

    def result(self, history, logs) -> FitResult:
        """The FitResult of the epochs in `history`, with `logs` as its final logs."""
        trainer = self.trainer
        return FitResult(
            model=trainer.model, strategy=trainer.strategy, records=list(history), logs=logs,
            total_seconds=time.perf_counter() - self.started, strategy_description=trainer.description,
            replicas=trainer.replicas, global_batch=trainer.global_batch, start_epoch=self.start.epoch,
            checkpoint=self.checkpoints.latest, history=_keras_history(trainer.model), workers=trainer.placement.workers)

    def train(self) -> FitResult:
        """Restores, trains to the last epoch, then writes the metrics file and the export; the FitResult."""
        trainer, outputs, config = self.trainer, self.outputs, self.config
        self.start = self.restore()
        observers = _observers(config, outputs, trainer, self.task,
                               lambda history: self.result(history, dict(history[-1].logs)).write_json(
                                   outputs.metrics_json))
        with contextlib.closing(observers), _lost_peers_explained(self.cluster, self.checkpoints), input_errors():
            loop = Loop(trainer, config.loop, self.checkpoints, observers, config.step_options.nan_policy)
            history = loop.run(self.start, self.stop)
        final = self.result(history, dict(history[-1].logs) if history else _final_evaluation(trainer))
        log.info("Final: %s; total time: %.1f s", format_logs(final.logs) or "no evaluation data", final.total_seconds)
        if outputs.metrics_json:
            final.write_json(outputs.metrics_json)
        if outputs.export_path and (self.cluster is None or self.cluster.is_chief):
            final.save(outputs.export_path)
            log.info("exported the model to %s (keras.models.load_model reads it)", outputs.export_path)
        log.info(describe_outputs(outputs, self.checkpoints.latest))
        return final


def _keras_history(model) -> dict:
    """The run's keras.callbacks.History (which the loop's Keras callbacks keep as model.history), as a dict."""
    history = getattr(model, "history", None)
    return {name: list(values) for name, values in getattr(history, "history", {}).items()}


def _final_evaluation(trainer) -> dict:
    """The logs of a run that trained nothing: the evaluation of the restored model."""
    with input_errors():
        return trainer.evaluate()


def progress_bar(verbose) -> bool:
    """Whether model.fit's verbose asks for Keras' progress bar here: 1 (or auto) on a terminal."""
    return verbose in (1, "auto") and sys.stdout.isatty()


def _observers(config: Config, outputs, trainer, task, write_metrics) -> Observers:
    """Everything that watches this run, in the order the loop calls them: the files, the log lines, the probes, the
    user's callbacks last (they see what was written)."""
    verbose, bar = config.loop.verbose, progress_bar(config.loop.verbose)
    observers = []
    if outputs.metrics_json:
        observers.append(MetricsFile(write_metrics))
    if outputs.log_dir:
        observers.append(TensorBoardScalars(outputs.log_dir))
    if verbose != 0 and not bar:
        observers.append(ProgressLog(show_examples=config.step_options.accumulate_steps > 1))
    observers.append(InputWaitMonitor(config.input, task.train.input_bound_hints(), trainer.on_gpus,
                                      virtual_cpus=trainer.replicas > 1 and not trainer.on_gpus))
    sampler = utilisation.start_sampler(trainer.visible_gpus, log)
    if sampler:
        observers.append(GpuUse(sampler))
    if config.loop.profile_steps:
        observers.append(Profile(config.loop.profile_steps, outputs.log_dir))
    if config.loop.steps_per_call == AUTO and trainer.steps_per_call > 1:
        observers.append(StepsPerCallTuner(trainer.steps_per_call))
    observers.append(KerasCallbacks(task.callbacks, trainer.model, config.loop.epochs, trainer.steps_per_epoch,
                                    verbose=1 if verbose == "auto" else verbose, progress_bar=bar))
    return Observers(observers)


@contextlib.contextmanager
def _lost_peers_explained(cluster, checkpoints):
    """In a cluster, turns the errors of a worker that went away into one that says what to do."""
    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.DeadlineExceededError,
            tf.errors.AbortedError, tf.errors.InternalError) as e:
        if cluster is None:
            raise
        raise multi_worker.lost_peer(e, cluster, checkpoints.latest) from None
