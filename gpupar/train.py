"""The distributed train and test steps (the inner loop) and the epoch loop (the outer loop)."""

import logging
import math
import signal
import time

import keras
import tensorflow as tf

from gpupar import data
from gpupar.checkpoint import Checkpoints, ModelDirLock, Position
from gpupar.cluster import detect_cluster
from gpupar.config import Config
from gpupar.devices import configure_devices
from gpupar.errors import GpuparError
from gpupar.interrupt import StopRequests, TrainingInterrupted
from gpupar.model import build_convnet
from gpupar.result import EpochRecord, FitResult
from gpupar.strategy import build_strategy, detected_plan
from gpupar.summaries import Summaries
from gpupar.teardown import keep_for_process

log = logging.getLogger("gpupar")
SUM = tf.distribute.ReduceOp.SUM


def _correct(logits, labels):
    predictions = tf.argmax(logits, axis=1, output_type=labels.dtype)
    return tf.reduce_sum(tf.cast(tf.equal(predictions, labels), tf.float32))


def _all_finite(tensors):
    """A scalar bool: no NaN or Inf in any of the tensors."""
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])


def _summed_over_steps(strategy, replica_step):
    """A tf.function(iterator, num_steps) that runs replica_step num_steps times in one call.

    replica_step returns two scalars; they come back summed over replicas and steps.
    """

    @tf.function
    def run(iterator, num_steps):
        first, second = tf.constant(0.0), tf.constant(0.0)
        for _ in tf.range(num_steps):
            a, b = strategy.run(replica_step, args=next(iterator))
            first += strategy.reduce(SUM, a, axis=None)
            second += strategy.reduce(SUM, b, axis=None)
        return first, second

    return run


def make_train_function(strategy, model, optimizer, global_batch: int, skip_nonfinite: bool = False):
    """Returns train(iterator, num_steps) -> (sum of step losses, correct predictions).

    It runs num_steps synchronous steps inside one tf.function call. With skip_nonfinite the
    optimizer must be a keras.optimizers.LossScaleOptimizer: a step whose loss or gradient is
    not finite on any replica is then dropped on all of them (no update, batch-norm statistics
    restored) and adds nothing to the sums.
    """

    def replica_step(images, labels):
        statistics = [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating]
        if skip_nonfinite:
            before = [tf.identity(v) for v in statistics]
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            # Each replica divides by the GLOBAL batch, so summing over replicas gives the mean.
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            differentiated = optimizer.scale_loss(loss) if skip_nonfinite else loss
        grads = tape.gradient(differentiated, model.trainable_variables)
        correct = _correct(logits, labels)
        if skip_nonfinite:
            finite = _all_finite([*grads, loss])
            bad = tf.distribute.get_replica_context().all_reduce(SUM, 1.0 - tf.cast(finite, tf.float32)) > 0
            # The loss-scale optimizer skips non-finite gradients but decides from one replica's:
            # poison every replica's so they all agree.
            grads = [tf.where(bad, tf.constant(float("nan"), g.dtype), g) for g in grads]
            for variable, value in zip(statistics, before):
                variable.assign(tf.where(bad, value, variable))
            loss, correct = tf.where(bad, 0.0, loss), tf.where(bad, 0.0, correct)
        # The all-reduce happens here: Keras 3's optimizer sums the gradients of all replicas
        # (one ReplicaContext.all_reduce(SUM) over the whole list, through the strategy's
        # cross-device ops) and then applies one identical Adam update on every replica.
        # Reducing them here as well would make every update num_replicas times too large.
        optimizer.apply(grads, model.trainable_variables)
        return loss, correct

    return _summed_over_steps(strategy, replica_step)


def make_test_function(strategy, model):
    """Returns test(iterator, num_steps) -> (correct predictions, examples seen)."""

    def replica_step(images, labels):
        logits = model(images, training=False)
        return _correct(logits, labels), tf.cast(tf.shape(labels)[0], tf.float32)

    return _summed_over_steps(strategy, replica_step)


def _check_finite(loss, epoch, first_step, last_step, checkpoint):
    """Raises when the loss of steps first_step..last_step (1-based, in the epoch) is not finite."""
    if not math.isfinite(loss):
        kept = f"the last good checkpoint {checkpoint} is kept" if checkpoint else "no checkpoint was written"
        where = f"step {last_step}" if first_step == last_step else f"one of steps {first_step}..{last_step}"
        raise GpuparError(
            f"training loss became {loss} at epoch {epoch}, {where}; stopped without saving "
            f"({kept}). Lower learning_rate, check the input data, or pass nan_policy=skip."
        )


def make_finite_check(model):
    """Returns a tf.function telling whether every float weight of the model is finite."""
    weights = [w for w in model.weights if tf.as_dtype(w.dtype).is_floating]

    return tf.function(lambda: _all_finite(weights))


def _crosses(before: int, after: int, every) -> bool:
    """True when a multiple of `every` lies in (before, after]."""
    return every is not None and after // every > before // every


class _Loop:
    """The outer loop: epochs of K-step calls, progress lines, evaluation, checkpoints, summaries."""

    def __init__(self, config, train, evaluate, checkpoints, summaries, steps_per_epoch, global_batch, updates,
                 weights_finite, loss_scale=None):
        self.config, self.train, self.evaluate = config, train, evaluate
        self.weights_finite = weights_finite
        self.updates = updates  # the optimizer's update counter; it stands still on skipped steps
        self.loss_scale = loss_scale  # halved by each skipped step; put back to 1 after every call
        self.checkpoints, self.summaries = checkpoints, summaries
        self.steps_per_epoch, self.global_batch = steps_per_epoch, global_batch

    def _save(self, epoch, step, save):
        """Saves through `save` unless a non-finite gradient has already spoilt the weights."""
        if not bool(self.weights_finite()):
            kept = self.checkpoints.latest
            raise GpuparError(
                f"the weights became non-finite (a NaN or Inf gradient) by epoch {epoch}, step {step}; "
                f"stopped without saving ({f'the last good checkpoint {kept} is kept' if kept else 'no checkpoint was written'}). "
                "Lower learning_rate, check the input data, or pass nan_policy=skip."
            )
        return save()

    def _chunk(self, step):
        """Steps in the next call: K, cut at the epoch end and at step-checkpoint boundaries."""
        num = min(self.config.steps_per_call, self.steps_per_epoch - step)
        every = self.config.checkpoint_every_steps
        if every is not None:
            num = min(num, every - step % every)
        return num

    def epoch(self, epoch, first_step, train_iterator, stop):
        """Trains the rest of one epoch from first_step; returns its EpochRecord."""
        c, spe, gb = self.config, self.steps_per_epoch, self.global_batch
        started = time.perf_counter()
        step, loss_total, correct_total = first_step, 0.0, 0.0
        shown_step, shown_time, shown_loss, shown_correct = step, started, 0.0, 0.0
        updates_before, skipped, shown_skipped = int(self.updates.numpy()), 0, 0
        while step < spe:
            if stop.signum:
                self._interrupt(stop, self._save(epoch, step, lambda: self.checkpoints.save_step(
                    Position(epoch, step), epoch * spe + step)))
            num_steps = self._chunk(step)
            loss_sum, correct_sum = self.train(train_iterator, tf.constant(num_steps))
            if self.loss_scale is not None:
                self.loss_scale.assign(1.0)
            step += num_steps
            loss_total += float(loss_sum)
            correct_total += float(correct_sum)
            _check_finite(loss_total, epoch, step - num_steps + 1, step, self.checkpoints.latest)
            if _crosses(step - num_steps, step, c.display_step) or step == spe or stop.signum:
                now, done = time.perf_counter(), step - shown_step
                if c.nan_policy == "skip":
                    skipped = step - first_step - (int(self.updates.numpy()) - updates_before)
                kept = max(done - (skipped - shown_skipped), 1)
                loss = (loss_total - shown_loss) / kept
                log.info(
                    "Epoch:[%d] [%d / %d] loss: %.4f, acc: %.4f, %s img/s%s", epoch, step, spe, loss,
                    (correct_total - shown_correct) / (kept * gb), f"{done * gb / (now - shown_time):,.0f}",
                    f", skipped {skipped - shown_skipped} non-finite step(s)" if skipped > shown_skipped else "",
                )
                shown_skipped = skipped
                self.summaries.step(epoch * spe + step, loss)
                shown_step, shown_time, shown_loss, shown_correct = step, now, loss_total, correct_total
            if step < spe and not stop.signum and _crosses(step - num_steps, step, c.checkpoint_every_steps):
                self._save(epoch, step, lambda: self.checkpoints.save_step(Position(epoch, step), epoch * spe + step))
        seconds = time.perf_counter() - started
        steps = spe - first_step
        kept = max(steps - skipped, 1)
        return EpochRecord(
            epoch=epoch, train_loss=loss_total / kept, train_accuracy=correct_total / (kept * gb),
            test_accuracy=self.evaluate(), seconds=seconds, images_per_second=steps * gb / seconds, steps=steps,
            skipped_steps=skipped,
        )

    @staticmethod
    def _interrupt(stop, saved):
        log.info("%s received: %s", signal.Signals(stop.signum).name, f"saved {saved}" if saved else "nothing to save")
        raise TrainingInterrupted(stop.signum, saved)

    def run(self, start: Position, train_iterator, stop):
        """Trains from `start` to config.epochs; returns the EpochRecords."""
        history = []
        if start.epoch >= self.config.epochs:
            log.info("nothing to train: the checkpoint already holds %d epoch(s), epochs=%d",
                     start.epoch, self.config.epochs)
        for epoch in range(start.epoch, self.config.epochs):
            record = self.epoch(epoch, start.step if epoch == start.epoch else 0, train_iterator, stop)
            history.append(record)
            self.summaries.epoch(epoch, record)
            saved = self._save(epoch, self.steps_per_epoch, lambda: self.checkpoints.save_epoch(epoch + 1))
            log.info(
                "Epoch:[%d] train loss: %.4f, train acc: %.4f, test acc: %.4f, %.1f s, %s img/s%s", epoch,
                record.train_loss, record.train_accuracy, record.test_accuracy, record.seconds,
                f"{record.images_per_second:,.0f}", f", saved {saved}" if saved else "",
            )
            if stop.signum:
                self._interrupt(stop, saved)
        return history


def train_and_evaluate(config: Config) -> FitResult:
    """Trains the ConvNet as the config says, evaluating and checkpointing after every epoch.

    In a cluster with parameter servers this process plays its task (gpupar/ps_train.py); in a
    synchronous cluster every worker runs this loop and only the chief keeps what it writes.
    """
    cluster = detect_cluster(slurm_ps=config.slurm_ps)
    if cluster is not None and cluster.num_ps:
        from gpupar import ps_train

        return ps_train.run_task(config, cluster)
    if cluster is None:
        with ModelDirLock(config.model_dir), StopRequests() as stop:
            return _train_and_evaluate(config, stop)
    from gpupar import multi_worker

    with ModelDirLock(config.model_dir if cluster.is_chief else None), StopRequests() as stop, \
            multi_worker.ScratchDir(cluster, config.model_dir) as scratch:
        return _train_and_evaluate(multi_worker.worker_config(config, cluster), stop, cluster, scratch.path)


def _train_and_evaluate(config: Config, stop, cluster=None, scratch_dir=None) -> FitResult:
    started = time.perf_counter()
    configure_devices(config)
    plan = detected_plan(config.strategy, config.devices, config.cross_device_ops, max_cpus=config.virtual_cpus or 1,
                         cluster=cluster)
    log.info(plan.describe())
    strategy = build_strategy(plan)  # first TensorFlow work: a multi-worker strategy must come before any op
    if cluster is not None:
        from gpupar.multi_worker import AgreedStop

        stop.reinstall()
        stop = AgreedStop(stop, strategy)
    keras.utils.set_random_seed(config.seed)

    splits = data.load_splits(config.dataset, config.data_dir)
    log.info("data: %d training and %d test images from %s", len(splits.train_labels), len(splits.test_labels),
             config.data_dir or f"TFDS {config.dataset}")
    global_batch = config.batch_size * strategy.num_replicas_in_sync
    steps_per_epoch = data.batches_per_epoch(len(splits.train_images), global_batch)
    if config.steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, config.steps_per_epoch)
    num_test_steps = data.test_steps(len(splits.test_images), global_batch)

    skip = config.nan_policy == "skip"
    with strategy.scope():
        model = build_convnet(config.dropout, config.sync_batch_norm, seed=config.seed)
        adam = keras.optimizers.Adam(config.learning_rate)
        # Keras' loss-scale optimizer is what skips non-finite steps. Its scale starts at 1, halves
        # on a skipped step (the loop puts it back to 1 after every call) and never grows; powers
        # of two scale float32 exactly.
        optimizer = keras.optimizers.LossScaleOptimizer(adam, initial_scale=1.0, dynamic_growth_steps=2**31 - 1) if skip else adam
        optimizer.build(model.trainable_variables)
    checkpoints = Checkpoints(config.model_dir, model, adam, config.max_to_keep, global_batch)
    saved_at = checkpoints.restore(config.resume)
    if scratch_dir is not None:
        checkpoints.write_to(scratch_dir)  # a non-chief worker: it restores the chief's, keeps nothing
    start = saved_at.rebatched(global_batch, steps_per_epoch)
    if start.step != saved_at.step:
        log.info("the checkpoint is %d steps of %d into epoch %d; with %d steps of %d per epoch now, this run "
                 "continues at step %d, on a data order of its own", saved_at.step, saved_at.global_batch,
                 saved_at.epoch, steps_per_epoch, global_batch, start.step)
    adam.learning_rate.assign(config.learning_rate)  # the checkpoint's value would win otherwise

    train_iterator = keep_for_process(iter(strategy.experimental_distribute_dataset(data.train_dataset(
        splits.train_images, splits.train_labels, global_batch, config.seed,
        start_step=start.epoch * steps_per_epoch + start.step,
    ))))
    test_iterator = keep_for_process(iter(strategy.experimental_distribute_dataset(
        data.test_dataset(splits.test_images, splits.test_labels, global_batch)
    )))
    test = make_test_function(strategy, model)

    def evaluate():
        correct, count = test(test_iterator, tf.constant(num_test_steps))
        return float(correct) / float(count)

    summaries = Summaries(config.log_dir)
    loop = _Loop(config, make_train_function(strategy, model, optimizer, global_batch, skip), evaluate,
                 checkpoints, summaries, steps_per_epoch, global_batch, adam.iterations,
                 make_finite_check(model), optimizer.dynamic_scale if skip else None)
    try:
        history = loop.run(start, train_iterator, stop)
    except (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.DeadlineExceededError,
            tf.errors.AbortedError, tf.errors.InternalError) as e:
        if cluster is None:
            raise
        from gpupar.multi_worker import lost_peer

        raise lost_peer(e, cluster, checkpoints.latest) from None
    finally:
        summaries.close()
    test_accuracy = history[-1].test_accuracy if history else evaluate()
    total = time.perf_counter() - started
    log.info("Test accuracy: %.4f; total time: %.1f s", test_accuracy, total)
    result = FitResult(
        model=model, strategy=strategy, history=history, test_accuracy=test_accuracy,
        total_seconds=total, strategy_description=plan.describe(), replicas=plan.num_replicas,
        global_batch=global_batch, start_epoch=start.epoch, checkpoint=checkpoints.latest,
    )
    if config.metrics_json:
        result.write_json(config.metrics_json)
    return result
