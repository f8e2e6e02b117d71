"""Is training input-bound? The verdict from measured input waits, and what to change.

The train step records, from in-graph timestamps, how long each step waited for its batch and
how long the step itself took. A step that waits for input leaves the device idle: that is
"GPU memory full, GPU-Util 0%".
"""

import dataclasses
import os

INPUT_BOUND = 0.3  # input wait above this fraction of step time: the pipeline bounds training
MIN_STEPS = 4  # steps measured before an epoch is judged


@dataclasses.dataclass
class InputWait:
    """Seconds waiting for input batches and seconds in the steps, over some steps."""

    waited: float = 0.0
    busy: float = 0.0
    steps: int = 0

    def add(self, waited: float, busy: float, steps: int):
        self.waited, self.busy, self.steps = self.waited + waited, self.busy + busy, self.steps + steps

    @property
    def fraction(self) -> float:
        """Input wait as a fraction of step time (the wait plus the step)."""
        total = self.waited + self.busy
        return self.waited / total if total > 0 else 0.0

    @property
    def input_bound(self) -> bool:
        """More than INPUT_BOUND of the step time went into waiting, over at least MIN_STEPS steps."""
        return self.steps >= MIN_STEPS and self.fraction > INPUT_BOUND

    def describe(self) -> str:
        """One line such as 'input wait 61% of step time: input-bound'."""
        if self.steps < MIN_STEPS:
            return f"input wait {self.fraction:.0%} of step time over {self.steps} step(s): too few to judge"
        return f"input wait {self.fraction:.0%} of step time: {'input-bound' if self.input_bound else 'not input-bound'}"


def likely_causes(input_options, hints=(), input_rate=None, step_rate=None, cpus=None) -> list:
    """The likely reasons the input pipeline starves the step, each with its fix, most likely first.

    input_options: the Config's InputOptions. hints: what the input form itself says may starve
    the step (DataAdapter.input_bound_hints), first. input_rate and step_rate (examples/s of the
    pipeline alone and of the step alone, from `gpupar diagnose`) tell a slow pipeline from one
    that is fast alone but starved of CPU; cpus is the number of cores the process may use
    (default: this process's affinity).
    """
    cpus = cpus or len(os.sched_getaffinity(0))
    causes = list(hints)
    if input_options.num_parallel_calls is not None and input_options.num_parallel_calls < cpus:
        causes.append(f"--num_parallel_calls={input_options.num_parallel_calls} maps on fewer threads than the "
                      f"{cpus} CPU cores: raise it, or leave it unset for AUTOTUNE")
    if input_options.data_threads is not None and input_options.data_threads < cpus:
        causes.append(f"--data_threads={input_options.data_threads} gives tf.data fewer threads than the {cpus} CPU "
                      "cores: raise it, or leave it unset for TensorFlow's shared pool")
    if input_rate is not None and step_rate is not None:
        ratio = input_rate / step_rate
        if ratio < 1:
            causes.append(f"the input pipeline alone is slower than the step ({input_rate:,.0f} against "
                          f"{step_rate:,.0f} examples/s): move per-example work into the step, or raise "
                          "--num_parallel_calls")
        elif ratio < 2:
            causes.append(f"the input pipeline alone is only {ratio:.1f}x as fast as the step: sharing the CPU "
                          "with the step, it falls behind; make it cheaper (per-example work into the step)")
        else:
            causes.append(f"the pipeline alone delivers {ratio:.0f}x what the step takes, but not while the step "
                          "runs: they compete for the same CPU cores (on a CPU-only machine, the step's own "
                          "threads); try a pool of its own with --data_threads")
    if not causes:
        causes.append("run `gpupar diagnose` with the same flags: it measures the pipeline and the step apart")
    return causes


def warning(wait: InputWait, input_options, hints=(), gpus: bool = False) -> str:
    """The warning for an input-bound run: the measurement, then the likely causes and fixes.

    `gpus`: whether the run's devices are GPUs, where the sign is the well-known one.
    """
    sign = " (memory full, GPU-Util near 0%)" if gpus else ""
    return (f"training is input-bound: the step waited for input {wait.fraction:.0%} of the time, so the "
            f"devices sat idle{sign}. Likely: {'; '.join(likely_causes(input_options, hints))}")
