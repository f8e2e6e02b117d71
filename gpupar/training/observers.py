"""What watches training: one interface, called by the loop at its points like the user's Keras callbacks.

The loop (gpupar.training.loop) calls every observer's hooks in the order of its list; each hook
does nothing unless an observer needs it. gpupar's own observers are the progress lines, the
input-wait monitor and its input-bound warning, the GPU sampler, the profile window, the
TensorBoard scalars and the metrics file; the user's Keras callbacks are one more observer.
"""

import dataclasses
import logging
import math
import statistics
import time
from typing import Callable, Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf

from gpupar.monitor import bottleneck
from gpupar.monitor.bottleneck import InputWait
from gpupar.monitor.profiling import ProfileWindow
from gpupar.training.inner_loop import Results
from gpupar.training.result import EpochRecord, format_logs

log = logging.getLogger("gpupar")


@dataclasses.dataclass(frozen=True)
class CallEnd:
    """One call of steps, finished.

    Attributes:
      done: Steps this process has asked for so far, this call's included.
      epoch: The epoch it belongs to.
      step: Steps of the epoch finished so far (from 1).
      results: What the call reported (a parameter-server engine reports steps later than asked).
      logs: logs() -> the epoch's logs so far ({"loss": ..., "<metric>": ...}).
    """

    done: int
    epoch: int
    step: int
    results: Results
    logs: Callable[[], Dict[str, float]]


@dataclasses.dataclass(frozen=True)
class ProgressLine:
    """The steps since the last progress line.

    Attributes:
      epoch: The epoch.
      step: Steps of the epoch finished so far.
      steps_per_epoch: Steps in the epoch.
      global_step: Steps of the whole run finished so far (the TensorBoard step).
      logs: The loss and metrics of the epoch so far (as Keras' progress bar shows them).
      examples_per_second: Training examples per second over these steps.
      examples: Examples of the epoch so far.
      skipped: Steps of these skipped as non-finite.
      by_worker: Steps each worker ran, where workers step on their own.
    """

    epoch: int
    step: int
    steps_per_epoch: int
    global_step: int
    logs: Dict[str, float]
    examples_per_second: float
    examples: int
    skipped: int = 0
    by_worker: Dict[str, int] = dataclasses.field(default_factory=dict)


class Observer:
    """One thing that watches training. Every hook does nothing unless overridden."""

    def on_train_begin(self):
        """Before the first epoch of this run."""

    def on_epoch_begin(self, epoch: int):
        """Before an epoch's first call (also of an epoch resumed in its middle)."""

    def call_size(self, done: int, num: int) -> int:
        """The steps the next call may run, at most `num`, `done` steps run so far (a window's edge cuts it)."""
        return num

    def on_call_begin(self, done: int, step: int):
        """Before a call of steps, `done` steps run so far, the call's first step the epoch's `step` (from 0)."""

    def on_call_end(self, call: CallEnd):
        """After a call of steps."""

    def on_progress(self, line: ProgressLine):
        """At a progress line: every display_step steps, at the epoch's end and before a stop."""

    def on_test_begin(self):
        """Before an evaluation (Keras' callback hook of the same name)."""

    def on_test_batch_begin(self, step: int):
        """Before a call of evaluation steps, its first the evaluation's `step` (from 0)."""

    def on_test_batch_end(self, step: int, logs: Dict[str, float]):
        """After a call of evaluation steps, its last the evaluation's `step`; `logs`: the evaluation's so far."""

    def on_test_end(self, logs: Dict[str, float]):
        """After an evaluation, with its logs (Keras' names, without "val_")."""

    def epoch_figures(self) -> dict:
        """Fields of the epoch's EpochRecord that this observer measured."""
        return {}

    def on_epoch_end(self, record: EpochRecord, saved: Optional[str], history: List[EpochRecord]):
        """After an epoch, its evaluation and its checkpoint (`saved`, or None)."""

    def on_train_end(self, history: List[EpochRecord]):
        """After training, also when it stopped early."""

    def close(self):
        """Releases what it holds; called once, whatever happened."""


OVERHEAD_SHARE = 0.05  # steps_per_call=auto: the host's work per call may cost at most this share of the steps' time
MEASURED_CALLS = 3  # calls after the first (traced) whose timings decide it


def steps_per_call_for(overhead_seconds: float, step_seconds: float, most: int,
                       share: float = OVERHEAD_SHARE) -> int:
    """The fewest steps per call whose time outweighs the host's overhead per call by 1/share, within [1, most].

    Keras 3 dropped tf-keras' steps_per_execution="auto"; the trade is the same: more steps per
    call amortise the host's work (the call, reading its results, the callbacks), fewer keep the
    progress and the callbacks frequent.
    """
    if step_seconds <= 0:
        return most
    needed = round(max(overhead_seconds, 0.0) / (share * step_seconds), 6)  # no step more for a rounding error
    return max(1, min(most, math.ceil(needed)))


class StepsPerCallTuner(Observer):
    """steps_per_call=auto: a few calls of few steps are timed, then every call takes steps_per_call_for's count.

    The time from one call's start to the next one's, less the time its steps took in the graph
    (the steps and their input waits, gpupar.training.inner_loop), is the host's work per call:
    the call itself, reading its results, and everything the loop and its observers do between
    calls. The first call, which traces, is left out. The choice is said in the log once.
    """

    def __init__(self, most: int, probe_steps: int = 2):
        self.most, self.probe_steps = most, probe_steps
        self.chosen, self.calls, self.began, self.last, self.samples = None, 0, None, None, []

    def call_size(self, done: int, num: int) -> int:
        return min(num, self.chosen or self.probe_steps)

    def on_call_begin(self, done: int, step: int):
        now = time.perf_counter()
        if self.chosen is None and self.last is not None:  # the call before: its cycle, from its start to this one's
            in_graph, step = self.last
            self.samples.append((now - self.began - in_graph, step))
            if len(self.samples) == MEASURED_CALLS:
                self._choose()
        self.began, self.last = now, None

    def on_call_end(self, call: CallEnd):
        self.calls += 1
        results = call.results
        if self.chosen is None and self.calls > 1 and results.steps and results.busy is not None:  # the first traces
            self.last = (results.busy + (results.waited or 0.0), results.busy / results.steps)

    def on_epoch_end(self, record, saved, history):
        self.last = None  # a cycle over the epoch's end holds the evaluation and the checkpoint: not measured
        if self.chosen is None and self.samples:  # a short epoch: what it measured decides
            self._choose()

    def _choose(self):
        overhead = statistics.median(o for o, _ in self.samples)
        step = statistics.median(s for _, s in self.samples)
        self.chosen = steps_per_call_for(overhead, step, self.most)
        log.info("steps per call: auto chose %d: the host's work takes %.2f ms per call, a step %.2f ms (at most "
                 "%d%% of the time goes to the host)", self.chosen, overhead * 1e3, step * 1e3,
                 round(OVERHEAD_SHARE * 100))


def _workers_note(by_worker) -> str:
    """', updates by worker: 0: 16, 1: 16' where workers step on their own (parameter servers), else ''."""
    if not by_worker:
        return ""
    return ", updates by worker: " + ", ".join(f"{w}: {n}" for w, n in sorted(by_worker.items(), key=lambda i: int(i[0])))


class ProgressLog(Observer):
    """The progress lines, and one line per epoch: logs, seconds, examples/s and the checkpoint saved."""

    def __init__(self, show_examples: bool = False):
        self.show_examples = show_examples  # with accumulation, steps are updates: say the examples too

    def on_progress(self, line: ProgressLine):
        position = f"{line.step} / {line.steps_per_epoch}" + (
            f" updates, {line.examples:,} examples" if self.show_examples else "")
        log.info("Epoch:[%d] [%s] %s, %s examples/s%s%s", line.epoch, position, format_logs(line.logs),
                 f"{line.examples_per_second:,.0f}",
                 f", skipped {line.skipped} non-finite step(s)" if line.skipped else "", _workers_note(line.by_worker))

    def on_epoch_end(self, record, saved, history):
        log.info("Epoch:[%d] %s, %.1f s, %s examples/s, input wait %.0f%%%s%s", record.epoch, format_logs(record.logs),
                 record.seconds, f"{record.examples_per_second:,.0f}", 100 * record.input_wait_fraction,
                 _workers_note(record.updates_by_worker), f", saved {saved}" if saved else "")


class InputWaitMonitor(Observer):
    """How long the steps waited for their input, per epoch; one warning per run when training is input-bound.

    On several virtual CPUs a replica that waits for a CPU thread counts as waiting for input, so
    there the figure is logged but warns of nothing (gpupar diagnose tells the two apart).
    """

    def __init__(self, input_options, hints=(), on_gpus: bool = False, virtual_cpus: bool = False):
        self.input_options, self.hints, self.on_gpus = input_options, tuple(hints), on_gpus
        self.wait, self.warned = InputWait(), virtual_cpus  # warned already: nothing to warn of

    def on_epoch_begin(self, epoch):
        self.wait = InputWait()

    def on_call_end(self, call):
        if call.results.waited is not None:
            self.wait.add(call.results.waited, call.results.busy, call.results.steps)

    def epoch_figures(self):
        return {"input_wait_fraction": self.wait.fraction}

    def _warn_if_input_bound(self):
        if self.wait.input_bound and not self.warned:
            log.warning(bottleneck.warning(self.wait, self.input_options, self.hints, self.on_gpus))
            self.warned = True

    def on_progress(self, line):
        self._warn_if_input_bound()

    def on_epoch_end(self, record, saved, history):
        self._warn_if_input_bound()


class GpuUse(Observer):
    """GPU-Util and memory per epoch, from an NVML sampler (gpupar.monitor.utilisation)."""

    def __init__(self, sampler):
        self.sampler, self.gpus = sampler, []

    def on_epoch_begin(self, epoch):
        self.sampler.take()  # drops the samples of evaluation and saving since the last epoch

    def epoch_figures(self):
        self.gpus = self.sampler.take()
        utils = [g.mean_util_percent for g in self.gpus if g.mean_util_percent is not None]  # a MIG card has none
        return {"gpu_util_percent": statistics.fmean(utils) if utils else None,
                "gpu_memory_used_mb": max(g.max_memory_used_mb for g in self.gpus) if self.gpus else None}

    def on_epoch_end(self, record, saved, history):
        for gpu in self.gpus:
            log.info("Epoch:[%d] %s", record.epoch, gpu.describe())

    def close(self):
        self.sampler.stop()


class Profile(Observer):
    """A TensorBoard profile of a window of steps (gpupar.monitor.profiling); calls are cut at its edges."""

    def __init__(self, steps, log_dir):
        self.window = ProfileWindow(steps, log_dir)

    def call_size(self, done, num):
        return self.window.limit(done, num)

    def on_call_begin(self, done, step):
        self.window.before(done)

    def on_call_end(self, call):
        self.window.after(call.done)

    def close(self):
        self.window.stop()


class TensorBoardScalars(Observer):
    """TensorBoard scalars, under the logs' Keras names: step/<name> at each progress line, epoch/<name> per epoch.

    Also epoch/examples_per_second and epoch/input_wait_fraction.
    """

    def __init__(self, log_dir: str):
        self.writer = tf.summary.create_file_writer(log_dir)

    def on_progress(self, line):
        with self.writer.as_default(step=line.global_step):
            for name, value in line.logs.items():
                if not np.ndim(value):  # a metric's vector (at several thresholds) is no scalar
                    tf.summary.scalar(f"step/{name}", value)

    def on_epoch_end(self, record, saved, history):
        with self.writer.as_default(step=record.epoch):
            for name, value in record.logs.items():
                if not np.ndim(value):
                    tf.summary.scalar(f"epoch/{name}", value)
            tf.summary.scalar("epoch/examples_per_second", record.examples_per_second)
            tf.summary.scalar("epoch/input_wait_fraction", record.input_wait_fraction)
        self.writer.flush()

    def close(self):
        self.writer.close()


class MetricsFile(Observer):
    """The run's metrics file, written after every epoch's checkpoint: a run killed later keeps its epochs' records."""

    def __init__(self, write: Callable[[List[EpochRecord]], None]):
        self.write = write

    def on_epoch_end(self, record, saved, history):
        self.write(history)


class KerasCallbacks(Observer):
    """The user's Keras callbacks, called as model.fit calls them, with Keras' History and progress bar.

    Every hook model.fit calls: on_train_begin/end, on_epoch_begin/end with the epoch's logs,
    on_train_batch_begin/end around each call of steps with the epoch's logs so far (as model.fit
    with steps_per_execution), and the evaluation's on_test_begin/end and on_test_batch_begin/end
    (as model.fit's evaluate, with the same callbacks); params as model.fit sets them (verbose,
    epochs, steps); model.history is a keras.callbacks.History.
    """

    def __init__(self, callbacks, model, epochs: int, steps: int, verbose=0, progress_bar: bool = False):
        self.callbacks = keras.callbacks.CallbackList(list(callbacks), add_history=True, add_progbar=progress_bar,
                                                      model=model, epochs=epochs, steps=steps, verbose=verbose)

    def on_train_begin(self):
        self.callbacks.on_train_begin()

    def on_epoch_begin(self, epoch):
        self.callbacks.on_epoch_begin(epoch)

    def on_call_begin(self, done, step):
        self.callbacks.on_train_batch_begin(step)

    def on_call_end(self, call):
        if call.results.steps:
            self.callbacks.on_train_batch_end(call.step - 1, call.logs())

    def on_test_begin(self):
        self.callbacks.on_test_begin()

    def on_test_batch_begin(self, step):
        self.callbacks.on_test_batch_begin(step)

    def on_test_batch_end(self, step, logs):
        self.callbacks.on_test_batch_end(step, logs)

    def on_test_end(self, logs):
        self.callbacks.on_test_end(logs)

    def on_epoch_end(self, record, saved, history):
        self.callbacks.on_epoch_end(record.epoch, dict(record.logs))

    def on_train_end(self, history):
        self.callbacks.on_train_end(dict(history[-1].logs) if history else None)


class Observers(Observer):
    """A list of observers, called in order: itself an Observer."""

    def __init__(self, observers=()):
        self.observers = list(observers)

    def _each(self, hook, *args):
        for observer in self.observers:
            getattr(observer, hook)(*args)

    def on_train_begin(self):
        self._each("on_train_begin")

    def on_epoch_begin(self, epoch):
        self._each("on_epoch_begin", epoch)

    def call_size(self, done, num):
        for observer in self.observers:
            num = observer.call_size(done, num)
        return num

    def on_call_begin(self, done, step):
        self._each("on_call_begin", done, step)

    def on_call_end(self, call):
        self._each("on_call_end", call)

    def on_progress(self, line):
        self._each("on_progress", line)

    def on_test_begin(self):
        self._each("on_test_begin")

    def on_test_batch_begin(self, step):
        self._each("on_test_batch_begin", step)

    def on_test_batch_end(self, step, logs):
        self._each("on_test_batch_end", step, logs)

    def on_test_end(self, logs):
        self._each("on_test_end", logs)

    def epoch_figures(self):
        figures = {}
        for observer in self.observers:
            figures.update(observer.epoch_figures())
        return figures

    def on_epoch_end(self, record, saved, history):
        self._each("on_epoch_end", record, saved, history)

    def on_train_end(self, history):
        self._each("on_train_end", history)

    def close(self):
        self._each("close")
