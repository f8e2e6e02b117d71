"""The distributed train and test steps (the inner loop) and the epoch loop (the outer loop)."""

import contextlib
import dataclasses
import logging
import math
import signal
import statistics
import time

import keras
import tensorflow as tf

from gpupar import assembly, augment, bottleneck, data, utilisation
from gpupar.bottleneck import InputWait
from gpupar.checkpoint import Checkpoints, ModelDirLock, Position
from gpupar.model import model_signature
from gpupar.cluster import detect_cluster
from gpupar.config import MODEL_PARALLEL, Config
from gpupar.devices import configure_devices
from gpupar.errors import GpuparError
from gpupar.interrupt import StopRequests, TrainingInterrupted
from gpupar.outputs import describe_outputs, resolve_outputs
from gpupar.profiling import ProfileWindow
from gpupar.result import EpochRecord, FitResult
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


def _mean_arrival(batch):
    """The mean over replicas of a timestamp taken when all of that replica's share of `batch` exists."""
    # A distributed batch's leaves are PerReplica values; flattened, they list one tensor per replica.
    leaves = [tf.nest.flatten(leaf, expand_composites=True) for leaf in tf.nest.flatten(batch)]
    stamps = []
    for share in zip(*leaves):
        with tf.control_dependencies(list(share)):
            stamps.append(tf.timestamp())
    return tf.reduce_mean(tf.stack(stamps))


def steps_in_one_call(batch_step, timed=False):
    """A tf.function(iterator, num_steps) that runs batch_step on num_steps batches in one call.

    batch_step(batch) returns two scalars; they come back summed over the steps. With `timed`
    the function takes a third argument, skip_first_wait (default False), and also returns the seconds spent
    waiting for input batches and the rest of the call's time (the steps: forward, backward,
    update), read from in-graph timestamps so that measuring adds no host round trip. A step's
    wait is the mean over replicas of the time until the replica has its share of the batch (how
    long a device sits idle for input); skip_first_wait leaves out the wait for the first batch
    (a fresh pipeline filling up). On a GPU the timestamps are host-side: the call ends when its
    sums have reached the host.
    """

    @tf.function
    def run(iterator, num_steps):
        first, second = tf.constant(0.0), tf.constant(0.0)
        for _ in tf.range(num_steps):
            a, b = batch_step(next(iterator))
            first += a
            second += b
        return first, second

    @tf.function
    def timed_run(iterator, num_steps, skip_first_wait=False):
        first, second = tf.constant(0.0), tf.constant(0.0)
        began = tf.timestamp()
        waited = tf.constant(0.0, tf.float64)
        for i in tf.range(num_steps):
            # One iteration at a time, so a step asks for its batch once the one before it has
            # finished, update included. The while loop would otherwise start the next iteration's
            # ops early, and the rest of a step on another replica would count as waiting.
            tf.autograph.experimental.set_loop_options(parallel_iterations=1)
            with tf.control_dependencies([waited]):
                asked = tf.timestamp()
            with tf.control_dependencies([asked]):
                batch = next(iterator)
            arrived = _mean_arrival(batch)
            a, b = batch_step(batch)
            first += a
            second += b
            counted = tf.logical_not(tf.logical_and(skip_first_wait, tf.equal(i, 0)))
            waited += tf.where(counted, arrived - asked, tf.constant(0.0, tf.float64))
        with tf.device("/cpu:0"):
            on_host = tf.identity(tf.stack([first, second]))
        with tf.control_dependencies([on_host, waited]):
            ended = tf.timestamp()
        return first, second, waited, ended - began - waited

    return timed_run if timed else run


def _summed_over_steps(strategy, replica_step, timed=False):
    """steps_in_one_call of replica_step on every replica, its two scalars summed over replicas."""

    def batch_step(batch):
        a, b = strategy.run(replica_step, args=batch)
        return strategy.reduce(SUM, a, axis=None), strategy.reduce(SUM, b, axis=None)

    return steps_in_one_call(batch_step, timed)


def make_train_function(strategy, model, optimizer, global_batch: int, skip_nonfinite: bool = False,
                        augment_seed=None, jit_compile: bool = False):
    """Returns train(iterator, num_steps, skip_first_wait) -> (loss sum, correct, input wait s, step s).

    It runs num_steps synchronous steps inside one tf.function call; the sums are over replicas
    and steps, the seconds are from steps_in_one_call. With augment_seed, each replica warps
    its images (gpupar.augment) at the start of the step, on its own device. A
    keras.optimizers.LossScaleOptimizer (mixed_float16, or nan_policy=skip) skips a step whose
    gradients are not finite on any replica, on all of them; with skip_nonfinite such a step also
    leaves the batch-norm statistics as they were and adds nothing to the sums. With jit_compile
    each replica's step (forward, backward, update) is one XLA computation.
    """
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    def update(images, labels):
        statistics = [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating]
        if skip_nonfinite:
            before = [tf.identity(v) for v in statistics]
        with tf.GradientTape() as tape:
            logits = tf.cast(model(images, training=True), tf.float32)  # a mixed-precision model's are 16-bit
            per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            # Each replica divides by the GLOBAL batch, so summing over replicas gives the mean.
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            if model.losses:  # the LSTM has no weight penalty
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            differentiated = optimizer.scale_loss(loss) if scaled else loss
        grads = tape.gradient(differentiated, model.trainable_variables)
        correct = _correct(logits, labels)
        if scaled:
            finite = _all_finite([*grads, loss])
            bad = tf.distribute.get_replica_context().all_reduce(SUM, 1.0 - tf.cast(finite, tf.float32)) > 0
            # The loss-scale optimizer skips non-finite gradients but decides from one replica's:
            # poison every replica's so they all agree.
            grads = [tf.where(bad, tf.constant(float("nan"), g.dtype), g) for g in grads]
        if skip_nonfinite:
            for variable, value in zip(statistics, before):
                variable.assign(tf.where(bad, value, variable))
            loss, correct = tf.where(bad, 0.0, loss), tf.where(bad, 0.0, correct)
        # The all-reduce happens here: Keras 3's optimizer sums the gradients of all replicas
        # (one ReplicaContext.all_reduce(SUM) over the whole list, through the strategy's
        # cross-device ops) and then applies one identical Adam update on every replica.
        # Reducing them here as well would make every update num_replicas times too large.
        optimizer.apply(grads, model.trainable_variables)
        return loss, correct

    compiled = tf.function(update, jit_compile=True) if jit_compile else update

    def replica_step(images, labels):
        if augment_seed is not None:  # outside XLA: it has no CPU kernel for the image warp
            images = augment.random_affine(images, augment.device_seed(augment_seed, optimizer.iterations))
        return compiled(images, labels)

    return _summed_over_steps(strategy, replica_step, timed=True)


def assembled_train_function(run: assembly.Assembly):
    """make_train_function for an assembled run: its optimizer, augmentation and XLA choice."""
    return make_train_function(run.strategy, run.model, run.optimizer, run.global_batch, run.skips_nonfinite,
                               run.augment_seed, run.jit_compile)


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


@dataclasses.dataclass
class EpochTotals:
    """Sums over the steps of an epoch so far; a step checkpoint carries them into the resumed run.

    Attributes:
      steps: Steps run, skipped ones included.
      skipped: Steps dropped for a non-finite loss or gradient.
      images: Training examples of all those steps (for the speed).
      examples: Examples of the steps kept (for the means).
      loss: Sum over the kept steps of each step's mean loss times its examples.
      correct: Correct predictions in the kept steps.
      seconds: Wall time of the steps.
    """

    steps: int = 0
    skipped: int = 0
    images: int = 0
    examples: int = 0
    loss: float = 0.0
    correct: float = 0.0
    seconds: float = 0.0

    @classmethod
    def from_dict(cls, values) -> "EpochTotals":
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})

    def add(self, steps: int, skipped: int, global_batch: int, loss_sum: float, correct_sum: float):
        """Adds one call's steps: loss_sum is the sum of their mean losses (0 for a skipped step)."""
        self.steps, self.skipped = self.steps + steps, self.skipped + skipped
        self.images += steps * global_batch
        self.examples += (steps - skipped) * global_batch
        self.loss += loss_sum * global_batch
        self.correct += correct_sum

    def since(self, earlier: "EpochTotals") -> "EpochTotals":
        """The sums of the steps after `earlier`."""
        return EpochTotals(*(getattr(self, f.name) - getattr(earlier, f.name) for f in dataclasses.fields(self)))

    @property
    def mean_loss(self) -> float:
        return self.loss / max(self.examples, 1)

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.examples, 1)


class _Loop:
    """The outer loop: epochs of K-step calls, progress lines, evaluation, checkpoints, summaries."""

    def __init__(self, config, train, evaluate, checkpoints, summaries, steps_per_epoch, global_batch, updates,
                 weights_finite, loss_scale=None, gpu_sampler=None, on_gpus=False):
        self.config, self.train, self.evaluate = config, train, evaluate
        self.weights_finite = weights_finite
        self.updates = updates  # the optimizer's update counter; it stands still on skipped steps
        self.loss_scale = loss_scale  # halved by each skipped step; put back to 1 after every call
        self.checkpoints, self.summaries = checkpoints, summaries
        self.steps_per_epoch, self.global_batch = steps_per_epoch, global_batch
        self.profile = ProfileWindow(config.profile_steps, config.log_dir)
        self.done = 0  # steps run by this process, for the profile window
        self.warned = False  # the input-bound warning is given once per run
        self.wait = InputWait()  # this epoch's input waits
        self.gpu_sampler, self.gpus = gpu_sampler, []  # the GPUs' summaries over the last epoch
        self.on_gpus = on_gpus

    def _call(self, train_iterator, num_steps):
        """Runs one train call of num_steps steps; returns its (loss sum, correct sum) as floats."""
        self.profile.before(self.done)
        loss_sum, correct_sum, waited, busy = self.train(
            train_iterator, tf.constant(num_steps), tf.constant(self.done == 0))
        if self.loss_scale is not None:
            self.loss_scale.assign(1.0)
        self.wait.add(float(waited), float(busy), num_steps)
        self.done += num_steps
        self.profile.after(self.done)
        return float(loss_sum), float(correct_sum)

    def _warn_if_input_bound(self):
        if self.wait.input_bound and not self.warned:
            log.warning(bottleneck.warning(self.wait, self.config, self.on_gpus))
            self.warned = True

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
        num = min(self.config.steps_in_a_call(self.steps_per_epoch), self.steps_per_epoch - step)
        every = self.config.checkpoint_every_steps
        if every is not None:
            num = min(num, every - step % every)
        return self.profile.limit(self.done, num)

    def epoch(self, epoch, start: Position, train_iterator, stop):
        """Trains the rest of one epoch from `start`; returns its EpochRecord, the whole epoch's."""
        c, spe, gb = self.config, self.steps_per_epoch, self.global_batch
        began = time.perf_counter()
        totals = EpochTotals.from_dict(start.totals)  # the steps before start.step, in an earlier run
        step, shown, shown_time = start.step, dataclasses.replace(totals), began
        self.wait = InputWait()
        if self.gpu_sampler:
            self.gpu_sampler.take()  # drops the samples of evaluation and saving since the last epoch

        def position():
            return Position(epoch, step, totals=dataclasses.asdict(
                dataclasses.replace(totals, seconds=totals.seconds + time.perf_counter() - began)))

        while step < spe:
            if stop.signum:
                self._interrupt(stop, self._save(epoch, step, lambda: self.checkpoints.save_step(
                    position(), epoch * spe + step)))
            num_steps = self._chunk(step)
            updates_before = int(self.updates.numpy()) if c.nan_policy == "skip" else None
            loss_sum, correct_sum = self._call(train_iterator, num_steps)
            # The update counter stands still on a skipped step.
            skipped = 0 if updates_before is None else num_steps - (int(self.updates.numpy()) - updates_before)
            totals.add(num_steps, skipped, gb, loss_sum, correct_sum)
            step += num_steps
            _check_finite(totals.loss, epoch, step - num_steps + 1, step, self.checkpoints.latest)
            if _crosses(step - num_steps, step, c.display_step) or step == spe or stop.signum:
                now, interval = time.perf_counter(), totals.since(shown)
                log.info(
                    "Epoch:[%d] [%d / %d] loss: %.4f, acc: %.4f, %s img/s%s", epoch, step, spe, interval.mean_loss,
                    interval.accuracy, f"{interval.images / (now - shown_time):,.0f}",
                    f", skipped {interval.skipped} non-finite step(s)" if interval.skipped else "",
                )
                self._warn_if_input_bound()
                self.summaries.step(epoch * spe + step, interval.mean_loss)
                shown, shown_time = dataclasses.replace(totals), now
            if step < spe and not stop.signum and _crosses(step - num_steps, step, c.checkpoint_every_steps):
                self._save(epoch, step, lambda: self.checkpoints.save_step(position(), epoch * spe + step))
        totals.seconds += time.perf_counter() - began
        self.gpus = self.gpu_sampler.take() if self.gpu_sampler else []
        return EpochRecord(
            epoch=epoch, train_loss=totals.mean_loss, train_accuracy=totals.accuracy, test_accuracy=self.evaluate(),
            seconds=totals.seconds, images_per_second=totals.images / totals.seconds, steps=totals.steps,
            skipped_steps=totals.skipped, input_wait_fraction=self.wait.fraction, resumed_at_step=start.step,
            gpu_util_percent=statistics.fmean(g.mean_util_percent for g in self.gpus) if self.gpus else None,
            gpu_memory_used_mb=max(g.max_memory_used_mb for g in self.gpus) if self.gpus else None,
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
            record = self.epoch(epoch, start if epoch == start.epoch else Position(epoch), train_iterator, stop)
            history.append(record)
            self.summaries.epoch(epoch, record)
            saved = self._save(epoch, self.steps_per_epoch, lambda: self.checkpoints.save_epoch(epoch + 1))
            log.info(
                "Epoch:[%d] train loss: %.4f, train acc: %.4f, test acc: %.4f, %.1f s, %s img/s%s", epoch,
                record.train_loss, record.train_accuracy, record.test_accuracy, record.seconds,
                f"{record.images_per_second:,.0f}", f", saved {saved}" if saved else "",
            )
            log.info("Epoch:[%d] %s", epoch, self.wait.describe())
            for gpu in self.gpus:
                log.info("Epoch:[%d] %s", epoch, gpu.describe())
            self._warn_if_input_bound()
            if stop.signum:
                self._interrupt(stop, saved)
            if self.config.reached_target(record.test_accuracy):
                log.info("Epoch:[%d] test accuracy %.4f reached stop_at_accuracy=%s; stopping", epoch,
                         record.test_accuracy, self.config.stop_at_accuracy)
                break
        return history


@contextlib.contextmanager
def _lost_peers_explained(cluster, checkpoints):
    """In a cluster, turns the errors of a worker that went away into one that says what to do."""
    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.DeadlineExceededError,
            tf.errors.AbortedError, tf.errors.InternalError) as e:
        if cluster is None:
            raise
        from gpupar.multi_worker import lost_peer

        raise lost_peer(e, cluster, checkpoints.latest) from None


def train_and_evaluate(config: Config) -> FitResult:
    """Trains config.model as the config says, evaluating and checkpointing after every epoch.

    In a cluster with parameter servers this process plays its task (gpupar/ps_train.py); in a
    synchronous cluster every worker runs this loop and only the chief keeps what it writes.
    """
    cluster = detect_cluster(slurm_ps=config.slurm_ps)
    config = resolve_outputs(config, chief=cluster is None or cluster.is_chief)
    if cluster is not None and cluster.num_ps:
        from gpupar import ps_train

        return ps_train.run_task(config, cluster)
    if cluster is None:
        with ModelDirLock(config.model_dir if config.save else None), StopRequests() as stop:
            return _train_and_evaluate(config, stop)
    from gpupar import multi_worker

    with ModelDirLock(config.model_dir if cluster.is_chief and config.save else None), StopRequests() as stop, \
            multi_worker.ScratchDir(cluster, config.model_dir, config.save) as scratch:
        return _train_and_evaluate(multi_worker.worker_config(config, cluster), stop, cluster, scratch.path)


def _train_and_evaluate(config: Config, stop, cluster=None, scratch_dir=None) -> FitResult:
    started = time.perf_counter()
    if config.strategy == MODEL_PARALLEL:
        configure_devices(config)
        from gpupar import model_parallel  # it builds on this module's loop

        return model_parallel.train_and_evaluate(config, stop, started)
    run = assembly.assemble(config, cluster)
    if cluster is not None:
        from gpupar.multi_worker import AgreedStop

        stop.reinstall()  # TF's coordination service took SIGTERM over when the strategy started
        stop = AgreedStop(stop, run.strategy)
    strategy, model, adam, global_batch, steps_per_epoch = (
        run.strategy, run.model, run.adam, run.global_batch, run.steps_per_epoch)
    num_test_steps = data.test_steps(len(run.splits.test_images), global_batch)
    checkpoints = Checkpoints(config.model_dir, model, adam, config.max_to_keep, global_batch, model_signature(config), config.save)
    saved_at = checkpoints.restore(config.resume)
    if scratch_dir is not None:
        checkpoints.write_to(scratch_dir)  # a non-chief worker: it restores the chief's, keeps nothing
    start = saved_at.rebatched(global_batch, steps_per_epoch)
    if start.step != saved_at.step:
        log.info("the checkpoint is %d steps of %d into epoch %d; with %d steps of %d per epoch now, this run "
                 "continues at step %d, on a data order of its own", saved_at.step, saved_at.global_batch,
                 saved_at.epoch, steps_per_epoch, global_batch, start.step)
    adam.learning_rate.assign(config.learning_rate)  # the checkpoint's value would win otherwise

    train_iterator = assembly.train_iterator(config, run, start.epoch * steps_per_epoch + start.step)
    test_iterator = keep_for_process(iter(strategy.experimental_distribute_dataset(
        data.test_dataset(run.splits.test_images, run.splits.test_labels, global_batch)
    )))
    test = make_test_function(strategy, model)

    def evaluate():
        correct, count = test(test_iterator, tf.constant(num_test_steps))
        return float(correct) / float(count)

    summaries = Summaries(config.log_dir)
    train = assembled_train_function(run)
    with contextlib.ExitStack() as cleanup, _lost_peers_explained(cluster, checkpoints):
        cleanup.callback(summaries.close)
        gpu_sampler = utilisation.start_sampler(run.devices.visible_gpus, log)
        if gpu_sampler:
            cleanup.callback(gpu_sampler.stop)
        loop = _Loop(config, train, evaluate, checkpoints, summaries, steps_per_epoch, global_batch, adam.iterations,
                     make_finite_check(model), run.optimizer.dynamic_scale if run.skips_nonfinite else None,
                     gpu_sampler, on_gpus=any(d.startswith("/gpu") for d in run.plan.devices))
        cleanup.callback(loop.profile.stop)
        history = loop.run(start, train_iterator, stop)
    test_accuracy = history[-1].test_accuracy if history else evaluate()
    total = time.perf_counter() - started
    log.info("Test accuracy: %.4f; total time: %.1f s", test_accuracy, total)
    result = FitResult(
        model=model, strategy=strategy, history=history, test_accuracy=test_accuracy,
        total_seconds=total, strategy_description=run.plan.describe(), replicas=run.plan.num_replicas,
        global_batch=global_batch, start_epoch=start.epoch, checkpoint=checkpoints.latest,
    )
    if config.metrics_json:
        result.write_json(config.metrics_json)
    log.info(describe_outputs(config, checkpoints.latest))
    return result
