"""`gpupar diagnose`: is training bound by its input pipeline or by its step, and what to change.

    gpupar diagnose --augment --augment_on=host --dataset=fashion_mnist \
        --data_dir=/usr/share/datasets/fashion-mnist [--json]

With the same flags as training it builds the same strategy, pipeline and step, and measures
three rates: the train step alone (one batch kept on the devices, stepped again and again), the
input pipeline alone (batches pulled from the iterator, no model), and the two together as
training runs them (calls of steps_per_call steps, each read on the host), with the input-wait
monitor that training uses. Each rate is the best of three rounds, one after another.
"""

import dataclasses
import json
import logging
import time

import tensorflow as tf

from gpupar.config import Config
from gpupar.errors import GpuparError
from gpupar.monitor import bottleneck
from gpupar.monitor.bottleneck import InputWait
from gpupar.runtime.precision import machine_precision
from gpupar.training import modes
from gpupar.training.setup import build_trainer

log = logging.getLogger("gpupar")
WARM_UP_STEPS = 3  # traced and discarded before each measurement
ROUNDS = 3  # each rate is the best of this many rounds: other work on the machine only ever slows a round
STEP_SPEED = 0.8  # training at this share of the step-alone rate or more is bound by its step (noise: ~10%)
VIRTUAL_CPU_NOTE = ("on virtual CPUs the input-wait figure also counts a replica waiting for a CPU thread as "
                    "waiting for input, so the verdict comes from the three rates")


def verdict(input_rate: float, step_rate: float, together_rate: float) -> tuple:
    """(input_bound, bound_by) from the three rates: what holds training below its step's own speed.

    Training that runs near the step's own rate is bound by the step, whatever it waits; below
    it, by the input pipeline: one slower than the step alone, or one that is fast alone but
    takes the CPU the step needs.
    """
    if together_rate >= STEP_SPEED * step_rate:
        return False, "train step"
    if input_rate < step_rate:
        return True, "input pipeline"
    return True, "input pipeline sharing the CPU with the step"


@dataclasses.dataclass(frozen=True)
class Report:
    """The three rates (training examples/s), the input wait of the combined run, and the verdict.

    Attributes:
      strategy: The strategy's one-line description.
      global_batch: Examples per step over all replicas.
      steps: Timed steps in each measurement.
      input_examples_per_second: The input pipeline alone.
      step_examples_per_second: The train step alone, on one batch kept on the devices.
      together_examples_per_second: Pipeline and step together, as training runs them.
      input_wait_fraction: Share of step time the combined run waited for input.
      input_bound: Whether training is bound by its input pipeline (from the three rates: see verdict).
      bound_by: "train step", "input pipeline", or "input pipeline sharing the CPU with the step".
      recommendations: What to change, most likely first.
      notes: What the figures cannot tell here.
      precisions: {format: {"examples_per_second": ..., "loss": ...}} of float32 and the devices'
        faster format, trained from the same weights on the same batches as training runs
        (compare_precisions); the faster format's entry is {"error": ...} where the model fails
        in it; {} where the devices have none or the model is built already.
    """

    strategy: str
    global_batch: int
    steps: int
    input_examples_per_second: float
    step_examples_per_second: float
    together_examples_per_second: float
    input_wait_fraction: float
    input_bound: bool
    bound_by: str
    recommendations: tuple
    notes: tuple = ()
    precisions: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        """The report as indented JSON, for `gpupar diagnose --json`."""
        return json.dumps(dataclasses.asdict(self), indent=2)

    def format(self) -> str:
        """The report as the text `gpupar diagnose` prints."""
        rows = [
            ("input pipeline alone", self.input_examples_per_second),
            ("train step alone (one batch on the devices)", self.step_examples_per_second),
            ("together, as training runs", self.together_examples_per_second),
        ]
        lines = [f"{self.strategy}; global batch {self.global_batch}, {self.steps} timed steps each"]
        lines += [f"  {name:<45} {rate:>12,.0f} examples/s" for name, rate in rows]
        lines.append(f"input wait {self.input_wait_fraction:.0%} of step time; together "
                     f"{self.together_examples_per_second / self.step_examples_per_second:.0%} of the step alone: "
                     f"{'input-bound' if self.input_bound else 'not input-bound'}; training is bound by the {self.bound_by}")
        lines += [f"  recommended: {text}" for text in self.recommendations]
        if len(self.precisions) == 2:
            lines.append(self._precision_line())
        lines += [f"  note: {text}" for text in self.notes]
        return "\n".join(lines)

    def _precision_line(self) -> str:
        """float32 against the faster format: the rate ratio and the losses, or why the model fails in it."""
        (_, plain), (fast_name, fast) = self.precisions.items()
        if "error" in fast:
            return (f"number format: {fast_name} fails on this model ({fast['error']}); keep float32, or make its "
                    f"float32 and 16-bit tensors meet (a cast, or dtype='float32' on the layer whose output mixes)")
        return (f"number format: {fast_name} at {fast['examples_per_second'] / plain['examples_per_second']:.2f}x "
                f"float32's rate ({fast['examples_per_second']:,.0f} against {plain['examples_per_second']:,.0f} "
                f"examples/s); mean loss of the same {self.steps} steps {fast['loss']:.4f} against {plain['loss']:.4f}")


class _OneBatch:
    """An iterator that yields the same (already distributed) batch forever, so no input work runs."""

    def __init__(self, batch):
        self.batch = batch

    def __iter__(self):
        return self

    def __next__(self):
        return self.batch


@tf.function
def _pull(iterator, num_steps):
    """Takes num_steps batches from the iterator and touches them, so that they must arrive."""
    total = tf.constant(0, tf.int64)
    for _ in tf.range(num_steps):
        batch = next(iterator)
        touched = batch[1] if isinstance(batch, tuple) and len(batch) > 1 else batch  # the labels, else x
        for part in tf.nest.flatten(touched, expand_composites=True):
            if part.dtype.is_floating or part.dtype.is_integer or part.dtype.is_bool:
                total += tf.cast(tf.reduce_sum(tf.cast(part, tf.float32)), tf.int64)
            else:
                total += tf.cast(tf.size(part), tf.int64)
    return total


def _best(run, steps, warm_up=True):
    """(seconds, what it returned) of the fastest of ROUNDS runs of run(steps), one after another.

    A discarded run(WARM_UP_STEPS) first traces and fills the pipelines. The rounds follow each
    other with no other work between them, so a pipeline cannot fill its buffers ahead of a round.
    """
    if warm_up:
        run(WARM_UP_STEPS)
    fastest = None
    for _ in range(ROUNDS):
        started = time.perf_counter()
        returned = run(steps)
        seconds = time.perf_counter() - started
        if fastest is None or seconds < fastest[0]:
            fastest = (seconds, returned)
    return fastest


def diagnose(config: Config, task, mode, steps: int = 30) -> Report:
    """Measures the step alone, the pipeline alone and both together under `config`.

    Args:
      config: The training options to diagnose (a synchronous strategy).
      task: What training would train (gpupar.training.task.Task).
      mode: The run's mode (gpupar.training.modes.checked).
      steps: Timed steps in each measurement.

    Returns:
      The Report.

    Raises:
      GpuparError: too few steps, a strategy diagnose cannot time (model_parallel, parameter_server),
        or a bad option or input.
    """
    if steps < bottleneck.MIN_STEPS:
        raise GpuparError(f"diagnose_steps={steps}: judging needs at least {bottleneck.MIN_STEPS} timed steps")
    if not mode.diagnosable:
        takes = ", ".join(s for m in modes.MODES if m.diagnosable for s in m.strategies)
        raise GpuparError(f"gpupar diagnose times steps that run here, one call after another; strategy="
                          f"{config.distribution.strategy} runs them otherwise (use one of: {takes})")
    trainer = build_trainer(config, task, mode)

    # The step alone first, while no pipeline is running; the batch's own pipeline ends after it.
    one_batch = _OneBatch(next(trainer.start(0, limit=1)))
    step_seconds, _ = _best(lambda n: trainer.run_calls(one_batch, n), steps)

    pipeline = trainer.start(0, limit=WARM_UP_STEPS + ROUNDS * steps)  # stops once measured
    input_seconds, _ = _best(lambda n: _pull(pipeline, tf.constant(n)).numpy(), steps)

    together = trainer.start(0)
    trainer.run_calls(together, WARM_UP_STEPS, first_call=True)
    together_seconds, measured = _best(lambda n: trainer.run_calls(together, n), steps, warm_up=False)
    wait = InputWait(measured.waited, measured.busy, measured.steps)

    rates = [steps * trainer.global_batch / seconds for seconds in (input_seconds, step_seconds, together_seconds)]
    input_bound, bound_by = verdict(*rates)
    precisions = compare_precisions(config, task, mode, steps, trainer.placement.devices)
    virtual_cpus = not trainer.on_gpus and trainer.replicas > 1
    return Report(
        strategy=trainer.description.split(";")[0], global_batch=trainer.global_batch, steps=steps,
        input_examples_per_second=rates[0], step_examples_per_second=rates[1], together_examples_per_second=rates[2],
        input_wait_fraction=wait.fraction, input_bound=input_bound, bound_by=bound_by,
        recommendations=tuple(bottleneck.likely_causes(config.input, task.train.input_bound_hints(), rates[0], rates[1])
                              if input_bound
                              else ["training is bound by the step: the input pipeline needs no change"]),
        notes=(VIRTUAL_CPU_NOTE,) if virtual_cpus else (), precisions=precisions,
    )


def compare_precisions(config: Config, task, mode, steps: int, devices) -> dict:
    """{format: {"examples_per_second", "loss"}} of float32 and the devices' faster format (gpupar.runtime.precision).

    Each trains from the same seeded weights on the same batches, WARM_UP_STEPS then `steps`
    timed steps, as training runs them; the loss is the mean over the timed steps. {} where the
    devices have no faster format, the mode's step keeps float32, or the model is built already
    (its dtype policy is its own).
    """
    plan = machine_precision([d for d in devices if d.startswith("/gpu")])
    if not plan.fast or not mode.takes_step_options or task.model is not None:
        return {}
    seeded = dataclasses.replace(task, seeded=True)
    measured = {"float32": _timed_steps(config.replace(precision="float32"), seeded, mode, steps)}
    try:
        measured[plan.precision] = _timed_steps(config.replace(precision=plan.precision), seeded, mode, steps)
    except (TypeError, ValueError, tf.errors.OpError) as error:  # the model mixes float32 and 16-bit tensors itself
        measured[plan.precision] = {"error": str(error).strip().splitlines()[0]}
    return measured


def _timed_steps(config: Config, task, mode, steps: int) -> dict:
    """{"examples_per_second", "loss"} of `steps` steps after WARM_UP_STEPS, as training runs them."""
    trainer = build_trainer(config, task, mode)
    iterator = trainer.start(0)
    trainer.run_calls(iterator, WARM_UP_STEPS, first_call=True)
    started = time.perf_counter()
    results = trainer.run_calls(iterator, steps)
    loss = (results.loss / max(results.examples, 1.0) if results.step_logs is None
            else next(iter(results.step_logs.values()), 0.0))  # a model's own step: its first log, the last step's
    return {"examples_per_second": steps * trainer.global_batch / (time.perf_counter() - started), "loss": loss}
