"""One training run from a Config: cluster dispatch, output folders, locks, restore, the loop, the result.

    import gpupar
    result = gpupar.fit(model_fn, (x, y), eval_data=(x_test, y_test), strategy="mirrored")

In a synchronous cluster every worker runs the same loop and only the chief keeps what it writes
(gpupar.training.multi_worker); with parameter servers the chief coordinates and the other
tasks serve (gpupar.training.parameter_server).
"""

import contextlib
import logging
import time

import tensorflow as tf

from gpupar.config import PARAMETER_SERVERS, Config, check_mode, run_mode
from gpupar.monitor import utilisation
from gpupar.runtime.cluster import detect_cluster
from gpupar.training import multi_worker, parameter_server
from gpupar.training.checkpoint import Checkpoints, ModelDirLock
from gpupar.training.engine import build_engine
from gpupar.training.interrupt import StopRequests
from gpupar.training.loop import Loop
from gpupar.training.outputs import describe_outputs, resolve_outputs
from gpupar.training.result import FitResult, format_logs
from gpupar.training.task import Task
from gpupar.training.summaries import Summaries

log = logging.getLogger("gpupar")


def train_and_evaluate(config: Config, task: Task) -> FitResult:
    """Trains `task` as the config says, evaluating and checkpointing after every epoch.

    Args:
      config: The run's options.
      task: What to train (gpupar.training.task: gpupar.fit's arguments, or an MNIST preset).

    Returns:
      The FitResult: the model, its history and final logs.

    Raises:
      GpuparError: a bad option or input (before any step, nothing written), a failed save, a
        non-finite loss (the last good checkpoint is kept), a cluster that broke.
      TrainingInterrupted: SIGINT or SIGTERM, after a checkpoint.
    """
    cluster = detect_cluster(slurm_ps=config.slurm_ps)
    mode = run_mode(config, cluster)
    check_mode(config, mode)  # strategy=auto in a cluster with ps tasks decides the mode only now
    chief = cluster is None or cluster.is_chief
    config = resolve_outputs(config, chief=chief)
    if mode == PARAMETER_SERVERS and cluster is not None and cluster.task_type != "chief":
        parameter_server.serve(config, cluster)  # never returns
    started = time.perf_counter()
    engine = build_engine(config, task, cluster)  # every check of the input first: nothing is written before
    with contextlib.ExitStack() as held:
        held.enter_context(ModelDirLock(config.model_dir if chief and config.save else None))
        stop = held.enter_context(StopRequests())
        scratch = None
        if cluster is not None:
            # TF's coordination service took SIGTERM over when the strategy started.
            stop.reinstall()
            if mode != PARAMETER_SERVERS:
                scratch = held.enter_context(multi_worker.ScratchDir(cluster, config.model_dir, config.save)).path
                config = multi_worker.worker_config(config, cluster)
                stop = multi_worker.AgreedStop(stop, engine.strategy)  # every worker stops after the same step
        return _run(config, engine, task, stop, cluster, scratch, started)


def _run(config: Config, engine, task, stop, cluster, scratch_dir, started) -> FitResult:
    checkpoints = Checkpoints(config.model_dir, engine.model, engine.optimizer, config.max_to_keep,
                              engine.global_batch, engine.signature, config.save,
                              engine.update_optimizer if config.precision == "mixed_float16" else None)
    saved_at = checkpoints.restore(config.resume)
    if scratch_dir is not None:
        checkpoints.write_to(scratch_dir)  # a non-chief worker: it restores the chief's, keeps nothing
    start = saved_at.rebatched(engine.global_batch, engine.steps_per_epoch)
    if start.step != saved_at.step:
        log.info("the checkpoint is %d steps of %d into epoch %d; with %d steps of %d per epoch now, this run "
                 "continues at step %d, on a data order of its own", saved_at.step, saved_at.global_batch,
                 saved_at.epoch, engine.steps_per_epoch, engine.global_batch, start.step)
    if engine.learning_rate is not None:
        engine.optimizer.learning_rate.assign(engine.learning_rate)  # the checkpoint's value would win otherwise
    engine.start(start.epoch * engine.steps_per_epoch + start.step)

    summaries = Summaries(config.log_dir)
    with contextlib.ExitStack() as cleanup, _lost_peers_explained(cluster, checkpoints):
        cleanup.callback(summaries.close)
        gpu_sampler = utilisation.start_sampler(engine.visible_gpus, log)
        if gpu_sampler:
            cleanup.callback(gpu_sampler.stop)
        def write_metrics(so_far):  # after every epoch, so a run killed later keeps its epochs' records
            _result(engine, so_far, dict(so_far[-1].logs), started, start.epoch, checkpoints).write_json(
                config.metrics_json)

        loop = Loop(engine, config, checkpoints, summaries, task.callbacks, gpu_sampler,
                    after_epoch=write_metrics if config.metrics_json else None)
        cleanup.callback(loop.profile.stop)
        history = loop.run(start, stop)
    logs = dict(history[-1].logs) if history else engine.evaluate()
    result = _result(engine, history, logs, started, start.epoch, checkpoints)
    log.info("Final: %s; total time: %.1f s", format_logs(logs) or "no evaluation data", result.total_seconds)
    if config.metrics_json:
        result.write_json(config.metrics_json)
    if config.export_path and (cluster is None or cluster.is_chief):
        result.save(config.export_path)
        log.info("exported the model to %s (keras.models.load_model reads it)", config.export_path)
    log.info(describe_outputs(config, checkpoints.latest))
    return result


def _result(engine, history, logs, started, start_epoch, checkpoints) -> FitResult:
    """The FitResult of the epochs in `history`, this run's so far."""
    return FitResult(
        model=engine.model, strategy=engine.strategy, history=list(history), logs=logs,
        total_seconds=time.perf_counter() - started, strategy_description=engine.description, replicas=engine.replicas,
        global_batch=engine.global_batch, start_epoch=start_epoch, checkpoint=checkpoints.latest,
    )


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
