"""The outer loop, one for every mode: epochs of K-step calls, evaluation, checkpoints, stops; observers watch it.

The loop drives a Trainer (gpupar.training.trainer) and knows nothing of its mode: it asks for
calls of steps, adds up the results each call reports (a parameter-server trainer reports
steps that finished later than they were asked for), and at an epoch's end, or before it
saves, lets the trainer finish what is still in flight. Everything that watches it (progress
lines, TensorBoard, the metrics file, the input-wait monitor, the GPU sampler, the profile
window, the user's Keras callbacks) is an observer in one list (gpupar.training.observers),
called at the same points; `model.stop_training` stops it after a checkpoint.
"""

import dataclasses
import logging
import math
import signal
import time
from typing import Dict, List, Optional

from gpupar import keras_compat
from gpupar.errors import GpuparError
from gpupar.training.checkpoint import Position
from gpupar.training.inner_loop import Results
from gpupar.training.interrupt import TrainingInterrupted
from gpupar.training.observers import CallEnd, ProgressLine
from gpupar.training.result import EpochRecord

log = logging.getLogger("gpupar")


@dataclasses.dataclass
class EpochTotals:
    """Counts over the steps of an epoch so far; a step checkpoint carries them into the resumed run.

    The loss and metrics are not here: they are the model's own Keras metrics, which checkpoints
    hold with the model (Step.state).

    Attributes:
      steps: Steps run, skipped ones included.
      skipped: Steps dropped for a non-finite loss or gradient.
      examples: Training examples of all those steps (for the speed).
      seconds: Wall time of the steps.
      by_worker: Steps each worker ran (parameter servers), by worker index as a string.
      step_logs: What a model's own train_step returned at its last step so far, else None.
    """

    steps: int = 0
    skipped: int = 0
    examples: int = 0
    seconds: float = 0.0
    by_worker: Dict[str, int] = dataclasses.field(default_factory=dict)
    step_logs: Optional[Dict[str, float]] = None

    @classmethod
    def from_dict(cls, values) -> "EpochTotals":
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})

    def to_dict(self) -> dict:
        """The totals as JSON-able values (a step checkpoint holds them)."""
        return dataclasses.asdict(self)

    def copy(self) -> "EpochTotals":
        return EpochTotals.from_dict(self.to_dict())

    def add(self, results: Results, skipped: int):
        """Adds one call's finished steps, `skipped` of them dropped as non-finite."""
        self.steps, self.skipped = self.steps + results.steps, self.skipped + skipped
        self.examples += int(results.examples)
        for worker, steps in results.by_worker.items():
            self.by_worker[str(worker)] = self.by_worker.get(str(worker), 0) + steps
        if results.step_logs is not None:
            self.step_logs = dict(results.step_logs)

    def since(self, earlier: "EpochTotals") -> "EpochTotals":
        """The counts of the steps after `earlier`."""
        return EpochTotals(self.steps - earlier.steps, self.skipped - earlier.skipped, self.examples - earlier.examples,
                           self.seconds - earlier.seconds,
                           {w: n - earlier.by_worker.get(w, 0) for w, n in self.by_worker.items()}, self.step_logs)


def non_finite(results: Results):
    """(name, value) of the first figure of a call that is NaN or infinite (its loss, a model's own step's logs), else (None, None)."""
    for name, value in [("loss", results.loss), *(results.step_logs or {}).items()]:
        if isinstance(value, float) and not math.isfinite(value):
            return name, value
    return None, None


def _stopped_without_saving(latest_checkpoint) -> str:
    """What a stop for non-finite numbers says it left on disk, and what to do."""
    left = f"the last good checkpoint {latest_checkpoint} is kept" if latest_checkpoint else "no checkpoint was written"
    return f"stopped without saving ({left}). Lower learning_rate, check the input data, or pass nan_policy=skip."


def _crosses(before: int, after: int, every) -> bool:
    """True when a multiple of `every` lies in (before, after]."""
    return every is not None and after // every > before // every


class _Epoch:
    """An epoch under way: its sums, the steps asked for and finished, and the totals at the last progress line.

    A parameter-server trainer reports steps later than they were asked for, so `finished` may lag
    `asked` until the trainer's finish().
    """

    def __init__(self, epoch: int, start: Position):
        self.epoch, self.start = epoch, start
        self.began = time.perf_counter()
        self.totals = EpochTotals.from_dict(start.totals)  # the steps before start.step, in an earlier run
        self.shown, self.shown_time = self.totals.copy(), self.began
        self.asked = self.finished = start.step
        self.spoilt = False  # a non-finite loss that a callback stopped training at: the weights are not saved

    def so_far(self) -> EpochTotals:
        """The totals with the seconds so far: what a step checkpoint holds."""
        return dataclasses.replace(self.totals.copy(), seconds=self.totals.seconds + time.perf_counter() - self.began)


class Loop:
    """Trains a Trainer from a checkpoint's position to the last epoch, saving as it goes, watched by observers.

    Attributes:
      trainer: What runs the steps and the evaluation.
      options: The Config's LoopOptions.
      checkpoints: Where the loop saves (gpupar.training.checkpoint.Checkpoints).
      observers: Everything that watches training (gpupar.training.observers.Observers).
      nan_policy: "stop" or "skip" (a skipped step leaves the update counter where it was).
    """

    def __init__(self, trainer, options, checkpoints, observers, nan_policy: str = "stop"):
        self.trainer, self.options, self.checkpoints, self.observers = trainer, options, checkpoints, observers
        self.skips = nan_policy == "skip"
        self.input = self.stop = None  # set by run()
        self.done = 0  # steps this process asked for
        self.cut_short = False  # whether a callback stopped the last epoch before its end
        self.spoilt = False  # whether it stopped it at a non-finite loss: its weights are not saved

    def _call(self, current: _Epoch, num_steps: int):
        """Runs one call of num_steps steps and adds what it reports to the epoch."""
        trainer = self.trainer
        updates_before = int(trainer.updates.numpy()) if self.skips else 0
        self.observers.on_call_begin(self.done, current.asked)
        results = trainer.calls.run(self.input, num_steps, self.done == 0)
        self.done += num_steps
        # The update counter stands still on a skipped step.
        skipped = results.steps - (int(trainer.updates.numpy()) - updates_before) if self.skips else 0
        self._add(current, results, skipped)

    def _add(self, current: _Epoch, results: Results, skipped: int):
        """Adds the steps a call reports (`skipped` of them non-finite); tells the observers; a progress line when due.

        The observers hear of a non-finite loss first, as Keras' callbacks do: one that stops
        training (TerminateOnNaN) ends the epoch there, as in model.fit; else the run stops with
        gpupar's error, the last good checkpoint kept.
        """
        trainer = self.trainer
        before, current.finished = current.finished, current.finished + results.steps
        current.totals.add(results, skipped)
        self.observers.on_call_end(CallEnd(self.done, current.epoch, current.finished, results,
                                           lambda: trainer.logs(current.totals.step_logs)))
        name, value = non_finite(results)
        if name is not None:
            if not trainer.model.stop_training:
                where = f"step {current.finished}" if before + 1 == current.finished else \
                    f"one of steps {before + 1}..{current.finished}"
                raise GpuparError(f"training {name} became {value} at epoch {current.epoch}, {where}; "
                                  f"{_stopped_without_saving(self.checkpoints.latest)}")
            current.spoilt = True  # a callback stopped training at it: nothing more is saved
        display = self.options.display_step
        if results.steps and display and (_crosses(before, current.finished, display)
                                          or current.finished == trainer.steps_per_epoch or self.stop.signum):
            self._progress(current)

    def _progress(self, current: _Epoch):
        """Tells the observers about the steps since the last progress line."""
        now, interval = time.perf_counter(), current.totals.since(current.shown)
        per_epoch = self.trainer.steps_per_epoch
        self.observers.on_progress(ProgressLine(
            current.epoch, current.finished, per_epoch, current.epoch * per_epoch + current.finished,
            self.trainer.logs(current.totals.step_logs), interval.examples / (now - current.shown_time),
            current.totals.examples, interval.skipped, dict(interval.by_worker)))
        current.shown, current.shown_time = current.totals.copy(), now

    def _save(self, epoch, step, save):
        """Saves through `save` unless a non-finite gradient has already spoilt the weights."""
        if not bool(self.trainer.weights_finite()):
            raise GpuparError(f"the weights became non-finite (a NaN or Inf gradient) by epoch {epoch}, step {step}; "
                              f"{_stopped_without_saving(self.checkpoints.latest)}")
        return save()

    def _save_step(self, current: _Epoch):
        """Saves a step checkpoint once every step asked for is in the weights, and in the totals."""
        self._add(current, self.trainer.finish(), 0)
        position = Position(current.epoch, current.asked, totals=current.so_far().to_dict())
        return self._save(current.epoch, current.asked, lambda: self.checkpoints.save_step(
            position, current.epoch * self.trainer.steps_per_epoch + current.asked))

    def _chunk(self, step):
        """Steps in the next call: K, cut at the epoch end, at step-checkpoint boundaries and by the observers."""
        num = min(self.trainer.steps_per_call, self.trainer.steps_per_epoch - step)
        every = self.options.checkpoint_every_steps
        if every is not None:
            num = min(num, every - step % every)
        return self.observers.call_size(self.done, num)

    def epoch(self, epoch, start: Position) -> EpochRecord:
        """Trains the rest of one epoch from `start`; returns its EpochRecord, the whole epoch's.

        A callback that sets model.stop_training ends the epoch at that call, as in model.fit: the
        epoch is evaluated and recorded (with the steps it ran), after a step checkpoint where the
        weights are finite.

        Raises:
          TrainingInterrupted: a signal, after a step checkpoint.
        """
        per_epoch, every, stop = self.trainer.steps_per_epoch, self.options.checkpoint_every_steps, self.stop
        current, self.cut_short = _Epoch(epoch, start), False
        if start.step == 0:
            self.trainer.begin_epoch()
        while current.asked < per_epoch:
            if stop.signum:
                self._interrupt(stop, self._save_step(current))
            num_steps = self._chunk(current.asked)
            self._call(current, num_steps)
            current.asked += num_steps
            if current.asked < per_epoch and self.trainer.model.stop_training:
                self._add(current, self.trainer.finish(), 0)
                saved = None if current.spoilt else self._save_step(current)
                log.info("Epoch:[%d] a callback stopped training at step %d%s", epoch, current.asked,
                         f"; saved {saved}" if saved else "")
                self.cut_short = True
                break
            if current.asked < per_epoch and not stop.signum and _crosses(current.asked - num_steps, current.asked,
                                                                           every):
                self._save_step(current)
        self._add(current, self.trainer.finish(), 0)
        self.spoilt = current.spoilt
        return self._record(current)

    def _record(self, current: _Epoch) -> EpochRecord:
        """The whole epoch's EpochRecord, its evaluation and the observers' figures included."""
        totals = current.totals
        totals.seconds += time.perf_counter() - current.began
        figures = self.observers.epoch_figures()  # before the evaluation, which they do not measure
        logs = self.trainer.logs(totals.step_logs)  # before the evaluation, which resets the metrics
        evaluation = self.trainer.evaluate(self.observers) if self.options.evaluates_after(current.epoch) else {}
        return EpochRecord(
            epoch=current.epoch, logs={**logs, **evaluation},
            seconds=totals.seconds, examples_per_second=totals.examples / totals.seconds, steps=totals.steps,
            skipped_steps=totals.skipped, resumed_at_step=current.start.step,
            updates_by_worker=dict(totals.by_worker) or None, **figures)

    @staticmethod
    def _interrupt(stop, saved):
        log.warning("%s received: %s", signal.Signals(stop.signum).name,
                    f"saved {saved}" if saved else "nothing to save")
        raise TrainingInterrupted(stop.signum, saved)

    def run(self, start: Position, stop) -> List[EpochRecord]:
        """Trains from `start` to the last epoch; returns the EpochRecords of this run.

        The callbacks' on_train_begin may move the start to a later epoch, as in model.fit
        (BackupAndRestore restores its backup and says the epoch it holds).
        """
        history, epochs, self.stop = [], self.options.epochs, stop
        self.trainer.model.stop_training = False
        self.observers.on_train_begin()
        restored = keras_compat.initial_epoch(self.trainer.model)
        if restored is not None and restored > start.epoch:
            start = Position(restored)
        if start.epoch >= epochs:
            log.info("nothing to train: the checkpoint already holds %d epoch(s), epochs=%d", start.epoch, epochs)
        self.input = self.trainer.start(start.epoch * self.trainer.steps_per_epoch + start.step)
        for epoch in range(start.epoch, epochs):
            self.observers.on_epoch_begin(epoch)
            current = start if epoch == start.epoch else Position(epoch)
            record = self.epoch(epoch, current)
            history.append(record)
            stopped, saved = self.trainer.model.stop_training, None
            if not self.cut_short and not self.spoilt:  # a whole epoch, its weights finite: its checkpoint
                saved = self._save(epoch, self.trainer.steps_per_epoch, lambda: self.checkpoints.save_epoch(epoch + 1))
            self.observers.on_epoch_end(record, saved, history)
            if stop.signum:
                self._interrupt(stop, saved)
            reached = self.options.reached(record.logs)
            if reached:
                log.info("Epoch:[%d] %s; stopping", epoch, reached)
                break
            if stopped or self.trainer.model.stop_training:
                log.info("Epoch:[%d] a callback stopped training", epoch)
                break
        if start.epoch < epochs:
            self.trainer.finalize()  # as Keras' fit, once its epochs are done (or a callback stopped them)
        self.observers.on_train_end(history)
        return history
