"""The distributed train and test steps (the inner loop) and the epoch loop (the outer loop)."""

import logging
import math
import time

import keras
import tensorflow as tf

from gpupar import data
from gpupar.checkpoint import Checkpoints
from gpupar.config import Config
from gpupar.devices import configure_devices
from gpupar.errors import GpuparError
from gpupar.model import build_convnet
from gpupar.result import EpochRecord, FitResult
from gpupar.strategy import build_strategy, detected_plan
from gpupar.summaries import Summaries

log = logging.getLogger("gpupar")
SUM = tf.distribute.ReduceOp.SUM


def _correct(logits, labels):
    predictions = tf.argmax(logits, axis=1, output_type=labels.dtype)
    return tf.reduce_sum(tf.cast(tf.equal(predictions, labels), tf.float32))


def make_train_function(strategy, model, optimizer, global_batch: int):
    """Returns train(iterator, num_steps) -> (sum of step losses, correct predictions).

    It runs num_steps synchronous steps inside one tf.function call.
    """

    def replica_step(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            # Each replica divides by the GLOBAL batch, so summing over replicas gives the mean.
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        grads = tape.gradient(loss, model.trainable_variables)
        # The all-reduce happens here: Keras 3's optimizer sums the gradients of all replicas
        # (one ReplicaContext.all_reduce(SUM) over the whole list, through the strategy's
        # cross-device ops) and then applies one identical Adam update on every replica.
        # Reducing them here as well would make every update num_replicas times too large.
        optimizer.apply(grads, model.trainable_variables)
        return loss, _correct(logits, labels)

    @tf.function
    def train(iterator, num_steps):
        loss_sum, correct_sum = tf.constant(0.0), tf.constant(0.0)
        for _ in tf.range(num_steps):
            loss, correct = strategy.run(replica_step, args=next(iterator))
            loss_sum += strategy.reduce(SUM, loss, axis=None)
            correct_sum += strategy.reduce(SUM, correct, axis=None)
        return loss_sum, correct_sum

    return train


def make_test_function(strategy, model):
    """Returns test(iterator, num_steps) -> (correct predictions, examples seen)."""

    def replica_step(images, labels):
        logits = model(images, training=False)
        return _correct(logits, labels), tf.cast(tf.shape(labels)[0], tf.float32)

    @tf.function
    def test(iterator, num_steps):
        correct_sum, count_sum = tf.constant(0.0), tf.constant(0.0)
        for _ in tf.range(num_steps):
            correct, count = strategy.run(replica_step, args=next(iterator))
            correct_sum += strategy.reduce(SUM, correct, axis=None)
            count_sum += strategy.reduce(SUM, count, axis=None)
        return correct_sum, count_sum

    return test


def _check_finite(loss, epoch, step, checkpoint):
    if not math.isfinite(loss):
        kept = f"the last good checkpoint {checkpoint} is kept" if checkpoint else "no checkpoint was written"
        raise GpuparError(
            f"training loss became {loss} at epoch {epoch}, step {step}; stopped without saving "
            f"({kept}). Lower learning_rate or check the input data."
        )


def train_and_evaluate(config: Config) -> FitResult:
    """Trains the ConvNet as the config says, evaluating and checkpointing after every epoch."""
    started = time.perf_counter()
    configure_devices(config)
    plan = detected_plan(config.strategy, config.devices, config.cross_device_ops, max_cpus=config.virtual_cpus or 1)
    log.info(plan.describe())
    strategy = build_strategy(plan)
    keras.utils.set_random_seed(config.seed)

    splits = data.load_splits(config.dataset, config.data_dir)
    global_batch = config.batch_size * strategy.num_replicas_in_sync
    steps_per_epoch = data.batches_per_epoch(len(splits.train_images), global_batch)
    if config.steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, config.steps_per_epoch)
    num_test_steps = data.test_steps(len(splits.test_images), global_batch)

    with strategy.scope():
        model = build_convnet(config.dropout, config.sync_batch_norm, seed=config.seed)
        optimizer = keras.optimizers.Adam(config.learning_rate)
        optimizer.build(model.trainable_variables)
    checkpoints = Checkpoints(config.model_dir, model, optimizer, config.max_to_keep)
    start_epoch = checkpoints.restore(config.resume)
    optimizer.learning_rate.assign(config.learning_rate)  # the checkpoint's value would win otherwise
    last_checkpoint = config.resume_path or (checkpoints.manager.latest_checkpoint if checkpoints.manager else None)

    train_iterator = data.keep_for_process(iter(strategy.experimental_distribute_dataset(data.train_dataset(
        splits.train_images, splits.train_labels, global_batch, config.seed,
        start_step=start_epoch * steps_per_epoch,
    ))))
    test_iterator = data.keep_for_process(iter(strategy.experimental_distribute_dataset(
        data.test_dataset(splits.test_images, splits.test_labels, global_batch)
    )))
    train = make_train_function(strategy, model, optimizer, global_batch)
    test = make_test_function(strategy, model)
    summaries = Summaries(config.log_dir)

    def evaluate():
        correct, count = test(test_iterator, tf.constant(num_test_steps))
        return float(correct) / float(count)

    history = []
    if start_epoch >= config.epochs:
        log.info("nothing to train: the checkpoint already holds %d epoch(s), epochs=%d", start_epoch, config.epochs)
    for epoch in range(start_epoch, config.epochs):
        epoch_started = time.perf_counter()
        step, loss_total, correct_total = 0, 0.0, 0.0
        shown_step, shown_time, shown_loss, shown_correct = 0, epoch_started, 0.0, 0.0
        while step < steps_per_epoch:
            num_steps = min(config.steps_per_call, steps_per_epoch - step)
            loss_sum, correct_sum = train(train_iterator, tf.constant(num_steps))
            step += num_steps
            loss_total += float(loss_sum)
            correct_total += float(correct_sum)
            if step // config.display_step > (step - num_steps) // config.display_step or step == steps_per_epoch:
                now, done = time.perf_counter(), step - shown_step
                loss = (loss_total - shown_loss) / done
                _check_finite(loss, epoch, step, last_checkpoint)
                log.info(
                    "Epoch:[%d] [%d / %d] loss: %.4f, acc: %.4f, %s img/s", epoch, step, steps_per_epoch,
                    loss, (correct_total - shown_correct) / (done * global_batch),
                    f"{done * global_batch / (now - shown_time):,.0f}",
                )
                summaries.step(epoch * steps_per_epoch + step, loss)
                shown_step, shown_time, shown_loss, shown_correct = step, now, loss_total, correct_total
        seconds = time.perf_counter() - epoch_started
        record = EpochRecord(
            epoch=epoch,
            train_loss=loss_total / steps_per_epoch,
            train_accuracy=correct_total / (steps_per_epoch * global_batch),
            test_accuracy=evaluate(),
            seconds=seconds,
            images_per_second=steps_per_epoch * global_batch / seconds,
            steps=steps_per_epoch,
        )
        history.append(record)
        summaries.epoch(epoch, record)
        last_checkpoint = checkpoints.save(epoch + 1) or last_checkpoint
        log.info(
            "Epoch:[%d] train loss: %.4f, train acc: %.4f, test acc: %.4f, %.1f s, %s img/s%s", epoch,
            record.train_loss, record.train_accuracy, record.test_accuracy, seconds,
            f"{record.images_per_second:,.0f}", f", saved {last_checkpoint}" if checkpoints.manager else "",
        )

    summaries.close()
    test_accuracy = history[-1].test_accuracy if history else evaluate()
    total = time.perf_counter() - started
    log.info("Test accuracy: %.4f; total time: %.1f s", test_accuracy, total)
    result = FitResult(
        model=model, strategy=strategy, history=history, test_accuracy=test_accuracy,
        total_seconds=total, strategy_description=plan.describe(), replicas=plan.num_replicas,
        global_batch=global_batch, start_epoch=start_epoch, checkpoint=last_checkpoint,
    )
    if config.metrics_json:
        result.write_json(config.metrics_json)
    return result
