"""`gpupar diagnose`: is training bound by its input pipeline or by its step, and what to change.

    gpupar diagnose --augment --augment_on=host --dataset=fashion_mnist \
        --data_dir=/usr/share/datasets/fashion-mnist [--json]

With the same flags as training it builds the same strategy, pipeline and step, and measures
three rates: the input pipeline alone (batches pulled from the iterator, no model), the train
step alone (one batch kept on the devices, stepped again and again), and the two together, as
training runs them, with the input-wait monitor that training uses for its verdict.
"""

import dataclasses
import json
import logging
import time

import tensorflow as tf

from gpupar import bottleneck
from gpupar.bottleneck import InputWait
from gpupar.config import Config
from gpupar.setup import build_setup, train_iterator
from gpupar.train import make_train_function

log = logging.getLogger("gpupar")
WARM_UP_STEPS = 3  # traced and discarded before each measurement


@dataclasses.dataclass(frozen=True)
class Report:
    """The three rates (training images/s), the input wait of the combined run, and the verdict.

    Attributes:
      strategy: The strategy's one-line description.
      global_batch: Examples per step over all replicas.
      steps: Timed steps in each measurement.
      input_images_per_second: The input pipeline alone.
      step_images_per_second: The train step alone, on one batch kept on the devices.
      together_images_per_second: Pipeline and step together, as training runs them.
      input_wait_fraction: Share of step time the combined run waited for input.
      input_bound: Whether training is bound by its input pipeline.
      bound_by: "input pipeline" or "train step".
      recommendations: What to change, most likely first.
    """

    strategy: str
    global_batch: int
    steps: int
    input_images_per_second: float
    step_images_per_second: float
    together_images_per_second: float
    input_wait_fraction: float
    input_bound: bool
    bound_by: str
    recommendations: tuple

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def format(self) -> str:
        rows = [
            ("input pipeline alone", self.input_images_per_second),
            ("train step alone (one batch on the devices)", self.step_images_per_second),
            ("together, as training runs", self.together_images_per_second),
        ]
        lines = [f"{self.strategy}; global batch {self.global_batch}, {self.steps} timed steps each"]
        lines += [f"  {name:<45} {rate:>12,.0f} images/s" for name, rate in rows]
        lines.append(f"input wait {self.input_wait_fraction:.0%} of step time: "
                     f"{'input-bound' if self.input_bound else 'not input-bound'}; training is bound by the {self.bound_by}")
        lines += [f"  recommended: {text}" for text in self.recommendations]
        return "\n".join(lines)


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
        for labels in tf.nest.flatten(next(iterator)[1], expand_composites=True):
            total += tf.cast(tf.reduce_sum(labels), tf.int64)
    return total


def _timed(run, steps):
    """Seconds for run(WARM_UP_STEPS) discarded, then for run(steps); run returns the tensors to wait for."""
    tf.nest.map_structure(lambda t: t.numpy(), run(WARM_UP_STEPS))
    started = time.perf_counter()
    tf.nest.map_structure(lambda t: t.numpy(), run(steps))
    return time.perf_counter() - started


def _step_advice(config) -> list:
    if config.steps_per_call == 1:
        return ["training is bound by the step: run several steps per call (--steps_per_call) to cut per-step overhead"]
    return ["training is bound by the step: the input pipeline needs no change"]


def diagnose(config: Config, steps: int = 30) -> Report:
    """Measures the pipeline alone, the step alone and both together under `config`."""
    s = build_setup(config)
    batch_images = s.global_batch
    train = make_train_function(s.strategy, s.model, s.optimizer, s.global_batch, s.skips_nonfinite, s.augment_seed)

    pipeline = train_iterator(config, s)
    input_seconds = _timed(lambda n: _pull(pipeline, tf.constant(n)), steps)

    one_batch = _OneBatch(next(train_iterator(config, s)))
    step_seconds = _timed(lambda n: train(one_batch, tf.constant(n), tf.constant(False))[:2], steps)

    together = train_iterator(config, s)
    wait = InputWait()

    def run_together(n):
        loss, correct, waited, busy = train(together, tf.constant(n), tf.constant(True))
        if n == steps:
            wait.add(float(waited), float(busy), n)
        return loss, correct

    together_seconds = _timed(run_together, steps)
    input_bound = wait.input_bound
    rates = [steps * batch_images / seconds for seconds in (input_seconds, step_seconds, together_seconds)]
    return Report(
        strategy=s.plan.describe().split(";")[0], global_batch=s.global_batch, steps=steps,
        input_images_per_second=rates[0], step_images_per_second=rates[1], together_images_per_second=rates[2],
        input_wait_fraction=wait.fraction, input_bound=input_bound,
        bound_by="input pipeline" if input_bound else "train step",
        recommendations=tuple(bottleneck.likely_causes(config, rates[0], rates[1]) if input_bound
                              else _step_advice(config)),
    )
