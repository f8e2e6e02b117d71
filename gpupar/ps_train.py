"""Asynchronous data parallelism: ParameterServerStrategy with a ClusterCoordinator.

The chief is the coordinator: it builds the Keras 3 ConvNet and its Adam optimizer under
`strategy.scope()`, which places every variable (weights, batch-norm statistics, Adam's moments)
on the parameter servers, then schedules train steps onto the workers. Each scheduled step runs
on one worker: it reads the current variables, computes the gradients of its own batch and
applies them with Adam without waiting for any other worker. Keras 3's `model.fit` does not
support this strategy (keras-team/keras#18624), but its model and optimizer work inside such a
custom step. Worker and ps tasks only run a tf.distribute.Server until they are stopped.

An epoch is one pass over the training set in total: `steps_per_epoch` steps of `batch_size`
examples, spread over the workers as they free up. Each worker reads its own shard (batches
w, w+N, w+2N... of the seeded order), so together they see every batch once per pass.
"""

import logging
import math
import signal
import time

import keras
import tensorflow as tf

from gpupar import data
from gpupar.checkpoint import Checkpoints, ModelDirLock, Position
from gpupar.cluster import Cluster
from gpupar.config import Config
from gpupar.devices import configure_devices
from gpupar.errors import GpuparError
from gpupar.interrupt import StopRequests, TrainingInterrupted
from gpupar.model import build_convnet, model_signature
from gpupar.outputs import describe_outputs
from gpupar.result import EpochRecord, FitResult
from gpupar.strategy import build_strategy, detected_plan, plan_strategy
from gpupar.summaries import Summaries
from gpupar.teardown import keep_for_process

log = logging.getLogger("gpupar")
IN_FLIGHT_PER_WORKER = 2  # scheduled steps not yet fetched, per worker: enough to keep each busy


def run_task(config: Config, cluster: Cluster) -> FitResult:
    """Plays this process's task: coordinates training as chief, else serves until stopped."""
    plan_strategy(config.strategy, [], ["/cpu:0"], cross_device_ops=config.cross_device_ops, cluster=cluster)
    if config.sync_batch_norm:
        raise GpuparError("sync_batch_norm needs replicas that step together; parameter_server updates asynchronously")
    if config.nan_policy == "skip":
        raise GpuparError("nan_policy=skip drops a step on every replica at once; parameter_server has no such step "
                          "(use nan_policy=stop)")
    if cluster.task_type in ("worker", "ps"):
        serve(config, cluster)
    if cluster.task_type != "chief":
        raise GpuparError(f"{cluster.task_name}: gpupar has no {cluster.task_type} task in parameter-server mode")
    with ModelDirLock(config.model_dir if config.save else None), StopRequests() as stop:
        return _coordinate(config, cluster, stop)


def serve(config: Config, cluster: Cluster):
    """Runs this task's tf.distribute.Server until the process is stopped (it never returns)."""
    configure_devices(config)
    log.info("%s: %s serving on %s until stopped", cluster.describe(), cluster.task_name,
             cluster.jobs[cluster.task_type][cluster.task_index])
    server_config = tf.compat.v1.ConfigProto()
    # Each closure the coordinator sends needs an inter-op thread while it waits on the ps tasks;
    # with as few threads as cores (2 here) a worker can stall.
    server_config.inter_op_parallelism_threads = 4
    server = tf.distribute.Server(
        tf.train.ClusterSpec({job: list(a) for job, a in cluster.jobs.items()}),
        job_name=cluster.task_type, task_index=cluster.task_index, protocol="grpc", config=server_config,
        start=True,
    )
    server.join()


def _correct(logits, labels):
    return tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=1, output_type=labels.dtype), labels), tf.float32))


def make_worker_step(strategy, model, optimizer):
    """Returns train(iterator, num_steps) -> (loss sum, correct, worker index), run on one worker."""

    def replica_step(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            loss = tf.reduce_mean(per_example) + tf.add_n(model.losses)  # one replica: its batch is the batch
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)  # on the ps tasks, without waiting for others
        return loss, _correct(logits, labels)

    @tf.function
    def train(iterator, num_steps):
        loss, correct = tf.constant(0.0), tf.constant(0.0)
        for _ in tf.range(num_steps):
            step_loss, step_correct = strategy.run(replica_step, args=next(iterator))
            loss += step_loss
            correct += step_correct
        return loss, correct, tf.distribute.coordinator.experimental_get_current_worker_index()

    return train


def make_evaluation(model, test_iterator, num_steps):
    """Returns evaluate() -> test accuracy, computed on the coordinator from the ps variables."""

    @tf.function
    def test_pass():
        correct, count = tf.constant(0.0), tf.constant(0.0)
        for _ in tf.range(num_steps):
            images, labels = next(test_iterator)
            correct += _correct(model(images, training=False), labels)
            count += tf.cast(tf.shape(labels)[0], tf.float32)
        return correct / count

    return lambda: float(test_pass())


class _Epochs:
    """The coordinator's outer loop: schedule steps (a bounded number in flight), join, evaluate, save."""

    def __init__(self, config, coordinator, train, iterator, evaluate, checkpoints, summaries, steps_per_epoch,
                 num_workers):
        self.config, self.coordinator, self.train, self.iterator = config, coordinator, train, iterator
        self.evaluate, self.checkpoints, self.summaries = evaluate, checkpoints, summaries
        self.steps_per_epoch, self.num_workers = steps_per_epoch, num_workers
        self.max_in_flight = IN_FLIGHT_PER_WORKER * num_workers

    def epoch(self, epoch, first_step, stop):
        c, spe = self.config, self.steps_per_epoch
        started = time.perf_counter()
        pending, totals = [], {"loss": 0.0, "correct": 0.0, "steps": 0}
        updates = [0] * self.num_workers
        step, shown = first_step, first_step

        def collect(oldest):
            num_steps, remote = oldest
            loss, correct, worker = _fetch(self.coordinator, remote)
            totals["loss"] += float(loss)
            totals["correct"] += float(correct)
            totals["steps"] += num_steps
            updates[int(worker)] += num_steps

        while step < spe:
            if stop.signum:
                self.coordinator.join()
                for item in pending:
                    collect(item)
                saved = self.checkpoints.save_step(Position(epoch, step), epoch * spe + step)
                log.info("%s received: %s", signal.Signals(stop.signum).name, f"saved {saved}" if saved else "nothing to save")
                raise TrainingInterrupted(stop.signum, saved)
            while len(pending) >= self.max_in_flight:  # bounded: wait for the oldest before scheduling more
                collect(pending.pop(0))
            # Unless told otherwise, a closure per step: an epoch spreads evenly over the workers.
            num_steps = min(c.steps_per_call or 1, spe - step)
            pending.append((num_steps, self.coordinator.schedule(self.train, args=(self.iterator, num_steps))))
            step += num_steps
            done = first_step + totals["steps"]
            if done - shown >= c.display_step and totals["steps"]:
                log.info("Epoch:[%d] [%d / %d] loss: %.4f, acc: %.4f, updates by worker: %s", epoch, done, spe,
                         totals["loss"] / totals["steps"], totals["correct"] / (totals["steps"] * c.batch_size),
                         _updates(updates))
                self.summaries.step(epoch * spe + done, totals["loss"] / totals["steps"])
                shown = done
        self.coordinator.join()  # every step of the epoch has been applied
        for item in pending:
            collect(item)
        seconds = time.perf_counter() - started
        steps = totals["steps"]
        if not math.isfinite(totals["loss"]):
            raise GpuparError(f"training loss became {totals['loss']} in epoch {epoch}; stopped without saving "
                              f"(the last checkpoint {self.checkpoints.latest} is kept). Lower learning_rate.")
        record = EpochRecord(
            epoch=epoch, train_loss=totals["loss"] / max(steps, 1),
            train_accuracy=totals["correct"] / max(steps * c.batch_size, 1), test_accuracy=self.evaluate(),
            seconds=seconds, images_per_second=steps * c.batch_size / seconds, steps=steps,
        )
        return record, updates

    def run(self, start: Position, stop):
        history = []
        if start.epoch >= self.config.epochs:
            log.info("nothing to train: the checkpoint already holds %d epoch(s), epochs=%d",
                     start.epoch, self.config.epochs)
        for epoch in range(start.epoch, self.config.epochs):
            record, updates = self.epoch(epoch, start.step if epoch == start.epoch else 0, stop)
            history.append(record)
            self.summaries.epoch(epoch, record)
            saved = self.checkpoints.save_epoch(epoch + 1)
            log.info(
                "Epoch:[%d] train loss: %.4f, train acc: %.4f, test acc: %.4f, %.1f s, %s img/s, updates by "
                "worker: %s%s", epoch, record.train_loss, record.train_accuracy, record.test_accuracy,
                record.seconds, f"{record.images_per_second:,.0f}", _updates(updates),
                f", saved {saved}" if saved else "",
            )
            if stop.signum:
                raise TrainingInterrupted(stop.signum, saved)
            if self.config.reached_target(record.test_accuracy):
                log.info("Epoch:[%d] test accuracy %.4f reached stop_at_accuracy=%s; stopping", epoch,
                         record.test_accuracy, self.config.stop_at_accuracy)
                break
        return history


def _fetch(coordinator, remote):
    """remote.fetch() of a scheduled step, also when the step's worker fails meanwhile.

    TF marks a step's RemoteValue ready once the step's call has returned on the coordinator,
    when its outputs may still be the worker's to produce; the worker's thread then copies them
    to the coordinator under its failure handling, which schedules the step again if the worker
    died. A fetch() from here can take that copy over first, and then raises the dead worker's
    error (UnavailableError: Socket closed) itself, outside that handling, although TF re-runs
    the step. join() waits until every scheduled step has finished, re-runs included, and raises
    the error of a step that really failed; the step's outputs are then on the coordinator and
    the second fetch() returns them.
    """
    try:
        return remote.fetch()
    except tf.errors.OpError as e:
        log.warning("a step's worker failed while its result was fetched (%s); waiting for the re-run",
                    type(e).__name__)
        coordinator.join()
        return remote.fetch()


def _updates(updates) -> str:
    return ", ".join(f"{i}: {n}" for i, n in enumerate(updates))


def _coordinate(config: Config, cluster: Cluster, stop) -> FitResult:
    started = time.perf_counter()
    configure_devices(config)
    plan = detected_plan(config.strategy, config.devices, config.cross_device_ops, cluster=cluster)
    log.info(plan.describe())
    strategy = build_strategy(plan)  # first TensorFlow work, before anything else can start the runtime
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    stop.reinstall()
    keras.utils.set_random_seed(config.seed)

    splits = data.load_splits(config.dataset, config.data_dir)
    log.info("data: %d training and %d test images from %s", len(splits.train_labels), len(splits.test_labels),
             config.data_dir or f"TFDS {config.dataset}")
    batch, num_workers = config.batch_size, plan.num_replicas
    steps_per_epoch = data.batches_per_epoch(len(splits.train_images), batch)
    if config.steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, config.steps_per_epoch)

    with strategy.scope():
        model = build_convnet(config.dropout, seed=config.seed)
        optimizer = keras.optimizers.Adam(config.learning_rate)
        optimizer.build(model.trainable_variables)
    checkpoints = Checkpoints(config.model_dir, model, optimizer, config.max_to_keep, batch, model_signature(config), config.save)
    start = checkpoints.restore(config.resume).rebatched(batch, steps_per_epoch)
    optimizer.learning_rate.assign(config.learning_rate)

    first = start.epoch * steps_per_epoch + start.step

    def worker_dataset(_context):
        # This worker's shard of the seeded batch order, from where the checkpoint left off.
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        ds = data.train_dataset(splits.train_images, splits.train_labels, batch, config.seed, start_step=first)
        return ds.shard(num_workers, worker)

    per_worker = coordinator.create_per_worker_dataset(
        tf.function(lambda: strategy.distribute_datasets_from_function(worker_dataset)))
    iterator = keep_for_process(iter(per_worker))
    test_iterator = keep_for_process(iter(data.test_dataset(splits.test_images, splits.test_labels, batch)))
    evaluate = make_evaluation(model, test_iterator, data.test_steps(len(splits.test_images), batch))

    summaries = Summaries(config.log_dir)
    loop = _Epochs(config, coordinator, make_worker_step(strategy, model, optimizer), iterator, evaluate,
                   checkpoints, summaries, steps_per_epoch, num_workers)
    try:
        history = loop.run(start, stop)
    finally:
        summaries.close()
    test_accuracy = history[-1].test_accuracy if history else evaluate()
    total = time.perf_counter() - started
    log.info("Test accuracy: %.4f; total time: %.1f s", test_accuracy, total)
    result = FitResult(
        model=model, strategy=strategy, history=history, test_accuracy=test_accuracy, total_seconds=total,
        strategy_description=plan.describe(), replicas=num_workers, global_batch=batch, start_epoch=start.epoch,
        checkpoint=checkpoints.latest,
    )
    if config.metrics_json:
        result.write_json(config.metrics_json)
    log.info(describe_outputs(config, checkpoints.latest))
    return result
