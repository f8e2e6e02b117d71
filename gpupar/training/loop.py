"""The outer loop, one for every mode: epochs of K-step calls, progress lines, evaluation, checkpoints, stops.

The loop drives an Engine (gpupar.training.engine) and knows nothing of its mode: it asks for
calls of steps, adds up the results each call reports (a parameter-server engine reports
steps that finished later than they were asked for), and at an epoch's end, or before it
saves, lets the engine finish what is still in flight. It calls the Keras callbacks as
`model.fit` does: on_train_begin/end, on_epoch_begin/end with the epoch's logs, and
on_train_batch_end once per call; `model.stop_training` stops it after a checkpoint.
"""

import dataclasses
import logging
import math
import signal
import statistics
import time
from typing import Dict, List, Optional

import keras
import numpy as np

from gpupar.errors import GpuparError
from gpupar.monitor import bottleneck
from gpupar.monitor.bottleneck import InputWait
from gpupar.monitor.profiling import ProfileWindow
from gpupar.training.checkpoint import Position
from gpupar.training.interrupt import TrainingInterrupted
from gpupar.training.result import EpochRecord, format_logs
from gpupar.training.steps import Results

log = logging.getLogger("gpupar")


@dataclasses.dataclass
class EpochTotals:
    """Sums over the steps of an epoch so far; a step checkpoint carries them into the resumed run.

    Attributes:
      steps: Steps run, skipped ones included.
      skipped: Steps dropped for a non-finite loss or gradient.
      examples: Training examples of all those steps (for the speed).
      kept_examples: Examples of the steps kept (for the mean loss).
      loss: Sum over the kept steps of each step's loss times its examples.
      states: The metrics' states summed over the steps (gpupar.training.objective), flattened.
      seconds: Wall time of the steps.
      by_worker: Steps each worker ran (parameter servers), by worker index as a string.
    """

    steps: int = 0
    skipped: int = 0
    examples: int = 0
    kept_examples: int = 0
    loss: float = 0.0
    states: List[list] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    by_worker: Dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, values) -> "EpochTotals":
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})

    def to_dict(self) -> dict:
        """The totals as JSON-able values (a step checkpoint holds them)."""
        return dataclasses.asdict(self)

    def copy(self) -> "EpochTotals":
        return EpochTotals.from_dict(self.to_dict())

    def add(self, results: Results, skipped: int, global_batch: int):
        """Adds one call's finished steps, `skipped` of them dropped as non-finite."""
        self.steps, self.skipped = self.steps + results.steps, self.skipped + skipped
        self.examples += results.steps * global_batch
        self.kept_examples += (results.steps - skipped) * global_batch
        self.loss += results.loss * global_batch
        if results.states:
            self.states = [np.add(total, more).tolist() for total, more in zip(self.states, results.states)] if self.states else [
                np.asarray(s).tolist() for s in results.states]
        for worker, steps in results.by_worker.items():
            self.by_worker[str(worker)] = self.by_worker.get(str(worker), 0) + steps

    def since(self, earlier: "EpochTotals") -> "EpochTotals":
        """The sums of the steps after `earlier`."""
        states = [np.subtract(now, then).tolist() for now, then in zip(self.states, earlier.states or
                                                             [np.zeros_like(s) for s in self.states])]
        return EpochTotals(self.steps - earlier.steps, self.skipped - earlier.skipped, self.examples - earlier.examples,
                           self.kept_examples - earlier.kept_examples, self.loss - earlier.loss, states, self.seconds - earlier.seconds,
                           {w: n - earlier.by_worker.get(w, 0) for w, n in self.by_worker.items()})

    def logs(self, objective) -> dict:
        """{"loss": ..., "<metric>": ...} of these steps, Keras' names."""
        logs = {"loss": self.loss / max(self.kept_examples, 1)}
        if self.states:
            logs.update(objective.results(self.states))
        return logs


def _workers_note(by_worker) -> str:
    """', updates by worker: 0: 16, 1: 16' where workers step on their own (parameter servers), else ''."""
    if not by_worker:
        return ""
    return ", updates by worker: " + ", ".join(f"{w}: {n}" for w, n in sorted(by_worker.items(), key=lambda i: int(i[0])))


def _stopped_without_saving(latest_checkpoint) -> str:
    """What a stop for non-finite numbers says it left on disk, and what to do."""
    left = f"the last good checkpoint {latest_checkpoint} is kept" if latest_checkpoint else "no checkpoint was written"
    return f"stopped without saving ({left}). Lower learning_rate, check the input data, or pass nan_policy=skip."


def _check_finite(loss, epoch, first_step, last_step, checkpoint):
    """Raises when the loss of steps first_step..last_step (1-based, in the epoch) is not finite."""
    if not math.isfinite(loss):
        where = f"step {last_step}" if first_step == last_step else f"one of steps {first_step}..{last_step}"
        raise GpuparError(f"training loss became {loss} at epoch {epoch}, {where}; {_stopped_without_saving(checkpoint)}")


def _mean_util(gpus) -> Optional[float]:
    """The mean GPU-Util of the sampled GPUs that report one (a MIG card does not), or None."""
    utils = [g.mean_util_percent for g in gpus if g.mean_util_percent is not None]
    return statistics.fmean(utils) if utils else None


def _crosses(before: int, after: int, every) -> bool:
    """True when a multiple of `every` lies in (before, after]."""
    return every is not None and after // every > before // every


class _Epoch:
    """An epoch under way: its sums, the steps asked for and finished, and the totals at the last progress line.

    A parameter-server engine reports steps later than they were asked for, so `finished` may lag
    `asked` until the engine's finish().
    """

    def __init__(self, loop, epoch: int, start: Position, stop):
        self.loop, self.epoch, self.start, self.stop = loop, epoch, start, stop
        self.began = time.perf_counter()
        self.totals = EpochTotals.from_dict(start.totals)  # the steps before start.step, in an earlier run
        self.shown, self.shown_time = self.totals.copy(), self.began
        self.asked = self.finished = start.step

    def add(self, results: Results, skipped: int):
        """Adds the steps a call reports (`skipped` of them non-finite), with the callbacks and the progress line."""
        loop, engine, config = self.loop, self.loop.engine, self.loop.config
        before, self.finished = self.finished, self.finished + results.steps
        self.totals.add(results, skipped, engine.global_batch)
        _check_finite(self.totals.loss, self.epoch, before + 1, self.finished, loop.checkpoints.latest)
        if not results.steps:
            return
        loop.callbacks.on_train_batch_end(self.finished - 1, self.totals.logs(engine.objective))
        if _crosses(before, self.finished, config.display_step) or self.finished == engine.steps_per_epoch \
                or self.stop.signum:
            self._progress_line()

    def _progress_line(self):
        """Logs the steps since the last line: position, logs, speed; and writes them to TensorBoard."""
        loop, engine, per_epoch = self.loop, self.loop.engine, self.loop.engine.steps_per_epoch
        now, interval = time.perf_counter(), self.totals.since(self.shown)
        logs = interval.logs(engine.objective)
        position = f"{self.finished} / {per_epoch}" + (
            f" updates, {self.totals.examples:,} examples" if loop.config.accumulate_steps > 1 else "")
        log.info("Epoch:[%d] [%s] %s, %s examples/s%s%s", self.epoch, position, format_logs(logs),
                 f"{interval.examples / (now - self.shown_time):,.0f}",
                 f", skipped {interval.skipped} non-finite step(s)" if interval.skipped else "",
                 _workers_note(interval.by_worker))
        loop._warn_if_input_bound()
        loop.summaries.step(self.epoch * per_epoch + self.finished, logs)
        self.shown, self.shown_time = self.totals.copy(), now

    def save_step(self):
        """Saves a step checkpoint once every step asked for is in the weights, and in the totals."""
        loop, per_epoch = self.loop, self.loop.engine.steps_per_epoch
        self.add(loop.engine.finish(), 0)
        so_far = dataclasses.replace(self.totals.copy(), seconds=self.totals.seconds + time.perf_counter() - self.began)
        position = Position(self.epoch, self.asked, totals=so_far.to_dict())
        return loop._save(self.epoch, self.asked, lambda: loop.checkpoints.save_step(
            position, self.epoch * per_epoch + self.asked))

    def record(self, wait: InputWait, gpus) -> EpochRecord:
        """The whole epoch's EpochRecord, its evaluation included."""
        totals, engine = self.totals, self.loop.engine
        totals.seconds += time.perf_counter() - self.began
        return EpochRecord(
            epoch=self.epoch, logs={**totals.logs(engine.objective), **engine.evaluate()}, seconds=totals.seconds,
            examples_per_second=totals.examples / totals.seconds, steps=totals.steps, skipped_steps=totals.skipped,
            input_wait_fraction=wait.fraction, resumed_at_step=self.start.step,
            updates_by_worker=dict(totals.by_worker) or None, gpu_util_percent=_mean_util(gpus),
            gpu_memory_used_mb=max(g.max_memory_used_mb for g in gpus) if gpus else None,
        )


class _CallbackStop(Exception):
    """A callback set model.stop_training within an epoch; the loop has saved where it stood."""


class Loop:
    """Trains an engine from a checkpoint's position to config.epochs, saving as it goes.

    Attributes:
      engine: What runs the steps and the evaluation.
      config: The run's Config.
      checkpoints: Where the loop saves (gpupar.training.checkpoint.Checkpoints).
      summaries: The TensorBoard writer (gpupar.training.summaries.Summaries).
      callbacks: The Keras callbacks, as a keras.callbacks.CallbackList.
      gpu_sampler: The NVML sampler of the GPUs in use, or None.
      after_epoch: after_epoch(history) once an epoch's checkpoint is saved (the metrics file), or None.
    """

    def __init__(self, engine, config, checkpoints, summaries, callbacks=(), gpu_sampler=None, after_epoch=None):
        self.engine, self.config, self.checkpoints, self.summaries = engine, config, checkpoints, summaries
        self.after_epoch = after_epoch
        self.callbacks = keras.callbacks.CallbackList(list(callbacks), model=engine.model, epochs=config.epochs,
                                                      steps=engine.steps_per_epoch, verbose=0)
        self.gpu_sampler, self.gpus = gpu_sampler, []  # the GPUs' summaries over the last epoch
        self.profile = ProfileWindow(config.profile_steps, config.log_dir)
        self.done = 0  # steps this process asked for, for the profile window
        self.warned = False  # the input-bound warning is given once per run
        self.wait = InputWait()  # this epoch's input waits

    def _call(self, num_steps: int):
        """Runs one call of num_steps steps; returns (the results it reports, how many of them were skipped)."""
        skips = self.config.nan_policy == "skip"
        updates_before = int(self.engine.updates.numpy()) if skips else 0
        self.profile.before(self.done)
        results = self.engine.train(num_steps, self.done == 0)
        self.done += num_steps
        self.profile.after(self.done)
        if results.waited is not None:
            self.wait.add(results.waited, results.busy, results.steps)
        # The update counter stands still on a skipped step.
        skipped = results.steps - (int(self.engine.updates.numpy()) - updates_before) if skips else 0
        return results, skipped

    def _warn_if_input_bound(self):
        if self.wait.input_bound and not self.warned:
            log.warning(bottleneck.warning(self.wait, self.config, self.engine.on_gpus))
            self.warned = True

    def _save(self, epoch, step, save):
        """Saves through `save` unless a non-finite gradient has already spoilt the weights."""
        if not bool(self.engine.weights_finite()):
            raise GpuparError(f"the weights became non-finite (a NaN or Inf gradient) by epoch {epoch}, step {step}; "
                              f"{_stopped_without_saving(self.checkpoints.latest)}")
        return save()

    def _chunk(self, step):
        """Steps in the next call: K, cut at the epoch end and at step-checkpoint boundaries."""
        num = min(self.engine.steps_per_call, self.engine.steps_per_epoch - step)
        every = self.config.checkpoint_every_steps
        if every is not None:
            num = min(num, every - step % every)
        return self.profile.limit(self.done, num)

    def epoch(self, epoch, start: Position, stop) -> EpochRecord:
        """Trains the rest of one epoch from `start`; returns its EpochRecord, the whole epoch's.

        Raises:
          TrainingInterrupted: a signal, after a step checkpoint.
          _CallbackStop: a callback set model.stop_training, after a step checkpoint.
        """
        per_epoch = self.engine.steps_per_epoch
        self.wait = InputWait()
        if self.gpu_sampler:
            self.gpu_sampler.take()  # drops the samples of evaluation and saving since the last epoch
        current = _Epoch(self, epoch, start, stop)
        while current.asked < per_epoch:
            if stop.signum:
                self._interrupt(stop, current.save_step())
            num_steps = self._chunk(current.asked)
            current.add(*self._call(num_steps))
            current.asked += num_steps
            if current.asked < per_epoch and self.engine.model.stop_training:
                saved = current.save_step()
                log.info("Epoch:[%d] a callback stopped training at step %d%s", epoch, current.asked,
                         f"; saved {saved}" if saved else "")
                raise _CallbackStop()
            if current.asked < per_epoch and not stop.signum and _crosses(current.asked - num_steps, current.asked,
                                                                           self.config.checkpoint_every_steps):
                current.save_step()
        current.add(self.engine.finish(), 0)
        self.gpus = self.gpu_sampler.take() if self.gpu_sampler else []
        return current.record(self.wait, self.gpus)

    @staticmethod
    def _interrupt(stop, saved):
        log.info("%s received: %s", signal.Signals(stop.signum).name, f"saved {saved}" if saved else "nothing to save")
        raise TrainingInterrupted(stop.signum, saved)

    def run(self, start: Position, stop):
        """Trains from `start` to config.epochs; returns the EpochRecords."""
        history = []
        if start.epoch >= self.config.epochs:
            log.info("nothing to train: the checkpoint already holds %d epoch(s), epochs=%d",
                     start.epoch, self.config.epochs)
        self.engine.model.stop_training = False
        self.callbacks.on_train_begin()
        for epoch in range(start.epoch, self.config.epochs):
            self.callbacks.on_epoch_begin(epoch)
            try:
                record = self.epoch(epoch, start if epoch == start.epoch else Position(epoch), stop)
            except _CallbackStop:
                break
            history.append(record)
            self.summaries.epoch(epoch, record)
            saved = self._save(epoch, self.engine.steps_per_epoch, lambda: self.checkpoints.save_epoch(epoch + 1))
            if self.after_epoch is not None:
                self.after_epoch(history)
            log.info("Epoch:[%d] %s, %.1f s, %s examples/s%s%s", epoch, format_logs(record.logs), record.seconds,
                     f"{record.examples_per_second:,.0f}", _workers_note(record.updates_by_worker),
                     f", saved {saved}" if saved else "")
            if self.wait.steps:
                log.info("Epoch:[%d] %s", epoch, self.wait.describe())
            for gpu in self.gpus:
                log.info("Epoch:[%d] %s", epoch, gpu.describe())
            self._warn_if_input_bound()
            self.callbacks.on_epoch_end(epoch, dict(record.logs))
            if stop.signum:
                self._interrupt(stop, saved)
            reached = self.config.reached(record.logs)
            if reached:
                log.info("Epoch:[%d] %s; stopping", epoch, reached)
                break
            if self.engine.model.stop_training:
                log.info("Epoch:[%d] a callback stopped training", epoch)
                break
        self.callbacks.on_train_end(dict(history[-1].logs) if history else None)
        return history
