"""The one frozen configuration shared by the Python API, the CLI flags and the tests, in parts.

A Config holds one part per layer that reads it: `device_setup` (gpupar.runtime.devices),
`distribution` (the strategy and the modes), `step_options` (the train step), `input` (the input
pipelines), `loop` (the outer loop) and `outputs` (checkpoints, logs, metrics, export), plus the
`seed` that all of them share. Each layer receives only its part. Options are given flat, by
field name (`Config(epochs=3, strategy="mirrored")`, `--epochs=3`): every field name is unique
across the parts. The MNIST presets' own options are a part of their own, beside the Config
(gpupar.presets.mnist.MnistOptions); the options a mode cannot run are refused by the mode
(gpupar.training.modes), which the run asks before TensorFlow starts.

Importing this module does not import TensorFlow, so every value is checked before any
TensorFlow work starts.
"""

import dataclasses
import os
import re
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from gpupar.errors import GpuparError

STRATEGIES = ("auto", "one_device", "mirrored", "central_storage", "multi_worker_mirrored", "parameter_server")
# The strategy option's values: tf.distribute's, and the names of gpupar's own modes that are none of them
# (gpupar.training.modes, where each mode declares the names it takes; a test keeps the two agreeing).
STRATEGY_CHOICES = (*STRATEGIES, "model_parallel")
CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduction_to_one_device")
NAN_POLICIES = ("stop", "skip")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16", "auto")
_DEVICE_NAME = re.compile(r"^/(device:)?(cpu|gpu):\d+$", re.IGNORECASE)
_THREADS_HINT = " (0 leaves it to TensorFlow), or empty to let gpupar choose"
VERBOSE = ("auto", 0, 1, 2)
STEPS_PER_CALL = 10  # train steps per tf.function call when neither steps_per_call nor display_step says
AUTO, AUTO_MOST_STEPS = "auto", 1000  # steps_per_call=auto, and the most steps it may put in one call


# Each field's own rule: a function (name, value) that raises GpuparError for a bad value.
def whole(least: int):
    """A whole number >= least."""
    def rule(name, value):
        hint = _THREADS_HINT if name.endswith("_threads") else ""
        bound = "> 0" if least == 1 else f">= {least}"
        _check(_is_int(value) and value >= least, f"{name}={quote(value)}: must be a whole number {bound}{hint}")
    return rule


def whole_or_auto(least: int):
    """A whole number >= least, or "auto"."""
    def rule(name, value):
        _check(value == AUTO or (_is_int(value) and value >= least), f"{name}={quote(value)}: must be a whole number "
               f">= {least}, or auto")
    return rule


def number(what: str, within):
    """A number for which within(value) holds; `what` says which in the error."""
    def rule(name, value):
        _check(_is_number(value) and within(value), f"{name}={quote(value)}: must be {what}")
    return rule


def optional(rule):
    """The rule, or None (not given)."""
    return lambda name, value: None if value is None else rule(name, value)


def boolean(name, value):
    _check(isinstance(value, bool), f"{name}={quote(value)}: must be True or False")


def choice(names):
    """One of `names`."""
    def rule(name, value):
        _check(isinstance(value, str) and value in names, f"{name}={quote(value)} is unknown; choose one of: "
               f"{', '.join(names)}")
    return rule


def attribute_help(doc: str) -> Dict[str, str]:
    """{name: one-line help} from the Attributes section of a docstring."""
    helps, in_attributes = {}, False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped == "Attributes:":
            in_attributes = True
        elif in_attributes and ":" in stripped:
            name, text = stripped.split(":", 1)
            helps[name] = text.strip()
    return helps


class Options:
    """The base of a frozen part of options: parses its fields, then checks each one by its rule.

    A part declares `_rules` ({field: rule}), may parse fields from strings in `_parse` and checks
    fields that must agree in `_check`.
    """

    _rules: Mapping[str, Any] = {}

    def __post_init__(self):
        self._parse()
        for name, rule in self._rules.items():
            rule(name, getattr(self, name))
        self._check()

    def _parse(self):
        """Turns strings and lists given for a field into its value (flags give strings)."""

    def _check(self):
        """Checks the fields that must agree with each other."""

    def _set(self, name, value):
        object.__setattr__(self, name, value)

    @classmethod
    def field_names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def field_help(cls) -> Dict[str, str]:
        """Maps each field to its one-line help, from the part's Attributes docstring."""
        return attribute_help(cls.__doc__)


@dataclasses.dataclass(frozen=True)
class DeviceSetup(Options):
    """The devices TensorFlow makes: visible GPUs, GPU memory, virtual CPUs, placement and threads.

    Attributes:
      gpus: GPU indices to make visible, e.g. "0,1" (like CUDA_VISIBLE_DEVICES); empty for all.
      memory_growth: Allocate GPU memory as needed instead of all at once (TF1 allow_growth).
      memory_limit_mb: Cap each visible GPU at this many MiB.
      memory_fraction: Cap each visible GPU at this fraction of its memory (TF1 per_process_gpu_memory_fraction).
      soft_placement: Run ops that have no kernel on the requested device somewhere else.
      log_placement: Log the device every op runs on.
      virtual_cpus: Split the CPU into this many logical devices, for multi-device runs without GPUs.
      intra_op_threads: Threads one op may use; empty lets gpupar choose from the cores and replicas, 0 leaves it to TensorFlow.
      inter_op_threads: Ops run at once; empty lets gpupar choose from the cores and replicas, 0 leaves it to TensorFlow.
    """

    gpus: Optional[Tuple[int, ...]] = None
    memory_growth: bool = False
    memory_limit_mb: Optional[int] = None
    memory_fraction: Optional[float] = None
    soft_placement: bool = True
    log_placement: bool = False
    virtual_cpus: Optional[int] = None
    intra_op_threads: Optional[int] = None
    inter_op_threads: Optional[int] = None

    _rules = {"memory_growth": boolean, "memory_limit_mb": optional(whole(1)),
              "memory_fraction": optional(number("a fraction in (0, 1]", lambda v: 0 < v <= 1)),
              "soft_placement": boolean, "log_placement": boolean, "virtual_cpus": optional(whole(1)),
              "intra_op_threads": optional(whole(0)), "inter_op_threads": optional(whole(0))}

    def _parse(self):
        self._set("gpus", _parse_gpus(self.gpus))

    def _check(self):
        _check(self.memory_fraction is None or self.memory_limit_mb is None,
               "memory_fraction and memory_limit_mb both cap GPU memory; give only one of them")


@dataclasses.dataclass(frozen=True)
class Distribution(Options):
    """How training is spread over the devices and tasks: the strategy, and each mode's own options.

    Attributes:
      strategy: auto, one_device, mirrored, central_storage, multi_worker_mirrored, parameter_server or model_parallel.
      devices: Device names overriding detection, e.g. "/gpu:0,/gpu:1".
      cross_device_ops: All-reduce: auto, nccl, hierarchical_copy or reduction_to_one_device.
      stages: model_parallel: the layers after which a new stage starts, by name or index, e.g. "conv_out,dense_1" or "3,7" (Sequential or single-chain models); empty for the MNIST presets' own split.
      microbatches: model_parallel: pipeline each replica's batch as this many micro-batches.
      slurm_ps: Under SLURM, how many tasks are parameter servers (after task 0, the chief); 0 for synchronous.
      ps_shards: parameter_server: split each variable of 256 KiB or more into up to this many shards over the ps tasks (1: none); empty: one per ps task.
    """

    strategy: str = "auto"
    devices: Optional[Tuple[str, ...]] = None
    cross_device_ops: str = "auto"
    stages: Optional[Tuple[Union[str, int], ...]] = None
    microbatches: int = 1
    slurm_ps: int = 0
    ps_shards: Optional[int] = None

    _rules = {"strategy": choice(STRATEGY_CHOICES), "cross_device_ops": choice(CROSS_DEVICE_OPS),
              "microbatches": whole(1), "slurm_ps": whole(0), "ps_shards": optional(whole(1))}

    def _parse(self):
        self._set("devices", _parse_devices(self.devices))
        self._set("stages", _parse_stages(self.stages))


@dataclasses.dataclass(frozen=True)
class StepOptions(Options):
    """What one train step computes, and how.

    Attributes:
      learning_rate: Adam learning rate.
      accumulate_steps: Add up the gradients of this many batches on each replica, then all-reduce and update once: one step on an N-times larger batch, in the memory of one batch (synchronous strategies).
      nan_policy: A step with a NaN or Inf loss or gradient: stop (error, last checkpoint kept) or skip it.
      precision: float32, mixed_bfloat16 (CPUs with bfloat16 units, GPUs of compute capability 8.0+), mixed_float16 (GPUs of 7.x; with dynamic loss scaling), or auto: the 16-bit format of these devices' matrix units (faster on large matrix products; gpupar diagnose measures both on your model).
      jit_compile: Compile each replica's train step with XLA, on one device or between GPUs (between CPU replicas XLA has no all-reduce: the step runs without it, and the log says so).
    """

    learning_rate: float = 1e-3
    accumulate_steps: int = 1
    nan_policy: str = "stop"
    precision: str = "float32"
    jit_compile: bool = False

    _rules = {"learning_rate": number("a number > 0", lambda v: v > 0), "accumulate_steps": whole(1),
              "nan_policy": choice(NAN_POLICIES), "precision": choice(PRECISIONS), "jit_compile": boolean}

    def _check(self):
        _check(not (self.precision == "mixed_float16" and self.nan_policy == "skip"),
               "precision=mixed_float16 already skips the steps whose gradients overflow (dynamic loss scaling); "
               "use it with nan_policy=stop")


@dataclasses.dataclass(frozen=True)
class InputOptions(Options):
    """The batch and the tf.data pipelines that make it.

    Attributes:
      batch_size: Examples per step over all replicas, as model.fit's batch_size: the replicas split it (times accumulate_steps per update); empty: 32, or the data's own batches.
      per_replica_batch_size: Examples per replica per step instead of batch_size: the global batch is this times the replicas; the MNIST presets' default is 1024.
      shuffle: Draw the arrays (and a PyDataset's batches) in a fresh seeded order every epoch, as model.fit's shuffle; False keeps their order.
      validation_batch_size: Examples per evaluation step over all replicas; empty: the training batch.
      validation_steps: Evaluate on at most this many batches; empty: the whole evaluation set.
      num_parallel_calls: Threads for the tf.data map; empty lets tf.data tune it (AUTOTUNE).
      deterministic: Keep the exact example order; False lets a ready example overtake a slow one (no exact replay on resume).
      data_threads: Give tf.data a private pool of this many threads; empty uses TensorFlow's shared pool.
    """

    batch_size: Optional[int] = None
    per_replica_batch_size: Optional[int] = None
    shuffle: bool = True
    validation_batch_size: Optional[int] = None
    validation_steps: Optional[int] = None
    num_parallel_calls: Optional[int] = None
    deterministic: bool = True
    data_threads: Optional[int] = None

    _rules = {"batch_size": optional(whole(1)), "per_replica_batch_size": optional(whole(1)), "shuffle": boolean,
              "validation_batch_size": optional(whole(1)), "validation_steps": optional(whole(1)),
              "num_parallel_calls": optional(whole(1)), "deterministic": boolean, "data_threads": optional(whole(1))}

    def _check(self):
        _check(self.batch_size is None or self.per_replica_batch_size is None,
               f"batch_size={self.batch_size} and per_replica_batch_size={self.per_replica_batch_size} both set the "
               "batch; give one of them (batch_size is split over the replicas, as in model.fit)")


@dataclasses.dataclass(frozen=True)
class LoopOptions(Options):
    """The outer loop: epochs, calls of steps, progress lines, stops and what it observes.

    Attributes:
      epochs: Total epochs to train, as model.fit's epochs; a resumed run stops at the same total.
      initial_epoch: The epoch to start at when there is no checkpoint to resume, as model.fit's initial_epoch.
      steps_per_epoch: Cap on the steps of each epoch; empty for a full pass (needed for data of unknown length).
      validation_freq: Evaluate after every this many epochs, as model.fit's validation_freq.
      verbose: What the run prints, as model.fit's verbose: 0 nothing but warnings, 1 a progress bar on a terminal (else one line per epoch), 2 one line per epoch, auto 1.
      display_step: Also print a progress line every this many steps; empty: none between epochs.
      steps_per_call: Train steps run inside one tf.function call (model.compile's steps_per_execution); auto: picked from the host's measured overhead per call against the step's time (said in the log); empty: display_step steps, or 10, capped at the epoch.
      stop_at: Stop after the first epoch whose logs reach these, e.g. "val_accuracy=0.9" (a loss: at or below); empty trains all epochs.
      checkpoint_every_steps: Also save within an epoch every this many steps; empty saves per epoch only.
      profile_steps: Capture a TensorBoard profile of this run's steps FIRST,LAST (e.g. 20,40) into log_dir.
    """

    epochs: int = 1
    initial_epoch: int = 0
    steps_per_epoch: Optional[int] = None
    validation_freq: int = 1
    verbose: Union[int, str] = "auto"
    display_step: Optional[int] = None
    steps_per_call: Optional[Union[int, str]] = None
    stop_at: Optional[Mapping[str, float]] = None
    checkpoint_every_steps: Optional[int] = None
    profile_steps: Optional[Tuple[int, int]] = None

    _rules = {"epochs": whole(0), "initial_epoch": whole(0), "steps_per_epoch": optional(whole(1)),
              "validation_freq": whole(1), "display_step": optional(whole(1)),
              "steps_per_call": optional(whole_or_auto(1)),
              "checkpoint_every_steps": optional(whole(1))}

    def _parse(self):
        self._set("stop_at", _parse_stop_at(self.stop_at))
        self._set("profile_steps", _parse_profile_steps(self.profile_steps))
        for name in ("verbose", "steps_per_call"):
            value = getattr(self, name)
            if isinstance(value, str) and value.isdigit():  # a flag gives a string
                self._set(name, int(value))

    def _check(self):
        _check(self.verbose in VERBOSE, f"verbose={quote(self.verbose)} is unknown; choose one of: 'auto', 0, 1, 2")

    def steps_in_a_call(self, steps_per_epoch: int) -> int:
        """Train steps per tf.function call: steps_per_call, else display_step (or 10) capped at the epoch; for auto,
        the most a call may take (the loop's tuner picks fewer: gpupar.training.observers.StepsPerCallTuner)."""
        if self.steps_per_call == AUTO:
            return min(AUTO_MOST_STEPS, steps_per_epoch)
        return self.steps_per_call or min(self.display_step or STEPS_PER_CALL, steps_per_epoch)

    def evaluates_after(self, epoch: int) -> bool:
        """Whether the evaluation runs after this epoch (from 0): every validation_freq epochs, as in Keras."""
        return (epoch + 1) % self.validation_freq == 0

    def reached(self, logs) -> Optional[str]:
        """Why training should stop after an epoch with these logs (stop_at), or None."""
        for name, target in (self.stop_at or {}).items():
            value = logs.get(name)
            if isinstance(value, (int, float)) and (value <= target if "loss" in name else value >= target):
                return f"{name} {value:.4f} reached {target}"
        return None


@dataclasses.dataclass(frozen=True)
class OutputOptions(Options):
    """What a run writes and reads back: checkpoints, TensorBoard logs, metrics, the exported model.

    Attributes:
      model_dir: Folder of this run: its checkpoints, and by default its TensorBoard logs and metrics; empty: a new numbered folder under runs/ (runs/001, ...; with resume, the latest).
      save: Write checkpoints, and by default TensorBoard logs and metrics, into model_dir; False writes no checkpoint, and only the log_dir and metrics_json given.
      resume: True continues from the latest checkpoint in model_dir (empty model_dir: the latest run under runs/); a path restores that checkpoint.
      max_to_keep: Checkpoints kept in model_dir; empty keeps all.
      log_dir: TensorBoard folder; empty: model_dir/tensorboard (none with save=False).
      metrics_json: Write the per-epoch history and final metrics to this JSON file, after every epoch; empty: model_dir/metrics.json (none with save=False).
      export_path: Save the trained model here as a .keras file that keras.models.load_model reads with Keras alone.
    """

    model_dir: Optional[str] = None
    save: bool = True
    resume: Union[bool, str] = False
    max_to_keep: Optional[int] = None
    log_dir: Optional[str] = None
    metrics_json: Optional[str] = None
    export_path: Optional[str] = None

    _rules = {"save": boolean, "max_to_keep": optional(whole(1))}

    def _parse(self):
        for name in ("model_dir", "log_dir", "metrics_json", "export_path"):
            if getattr(self, name) == "":
                self._set(name, None)
        if self.resume in ("", None):
            self._set("resume", False)

    def _check(self):
        if self.export_path is not None:
            _check(self.export_path.endswith(".keras"), f"export_path={quote(self.export_path)}: Keras saves models as "
                   ".keras files; give a path that ends in .keras")
        for name in ("log_dir", "metrics_json", "export_path"):
            path = getattr(self, name)
            if path is not None:
                _check(_can_create(path), f"{name}={quote(path)} cannot be written; choose a path in a folder you can "
                       "write")
        _check_resume(self)

    @property
    def resume_path(self) -> Optional[str]:
        """The checkpoint path given as `resume`, or None when resume is True/False."""
        return self.resume if isinstance(self.resume, str) else None


# The parts, in the order of the flags and the docs: (attribute of Config, class).
PARTS = (("distribution", Distribution), ("device_setup", DeviceSetup), ("input", InputOptions),
         ("step_options", StepOptions), ("loop", LoopOptions), ("outputs", OutputOptions))


@dataclasses.dataclass(frozen=True, init=False)
class Config:
    """Everything one training run needs, in one part per layer that reads it.

    Attributes:
      distribution: The strategy and each mode's options (Distribution).
      device_setup: The devices TensorFlow makes (DeviceSetup).
      input: The batch and its pipelines (InputOptions).
      step_options: The train step (StepOptions).
      loop: The outer loop (LoopOptions).
      outputs: Checkpoints, logs, metrics and export (OutputOptions).
      seed: Seed for weights, shuffling and dropout.
    """

    distribution: Distribution
    device_setup: DeviceSetup
    input: InputOptions
    step_options: StepOptions
    loop: LoopOptions
    outputs: OutputOptions
    seed: int

    def __init__(self, seed: int = 0, **options):
        """Builds every part from flat options, e.g. Config(epochs=3, strategy="mirrored").

        Raises:
          GpuparError: an unknown option (the message lists the valid ones) or a bad value.
        """
        unknown = sorted(set(options) - set(field_names()))
        if unknown:
            raise GpuparError(f"unknown option(s) {', '.join(unknown)}; valid options are: {', '.join(field_names())}")
        _check(_is_int(seed), f"seed={quote(seed)}: must be a whole number")
        object.__setattr__(self, "seed", seed)
        for attribute, part in PARTS:
            object.__setattr__(self, attribute, part(**{k: v for k, v in options.items() if k in part.field_names()}))
        _check_across_parts(self)

    @classmethod
    def from_options(cls, base: Optional["Config"] = None, **options) -> "Config":
        """A Config from flat options over `base` (or the defaults); unknown options are errors."""
        return cls(**options) if base is None else base.replace(**options)

    def replace(self, **options) -> "Config":
        """This Config with some flat options changed, checked again."""
        return Config(**{**self.options(), **options})

    def options(self) -> Dict[str, Any]:
        """Every field as a flat option: {name: value}."""
        flat = {"seed": self.seed}
        for attribute, _ in PARTS:
            part = getattr(self, attribute)
            flat.update({f.name: getattr(part, f.name) for f in dataclasses.fields(part)})
        return flat


def field_names():
    """Every flat option's name, in the order of the parts."""
    return [name for _, part in PARTS for name in part.field_names()] + ["seed"]


def field_help():
    """Maps each flat option to its one-line help, from the parts' Attributes docstrings."""
    helps = {name: text for _, part in PARTS for name, text in part.field_help().items()}
    helps["seed"] = attribute_help(Config.__doc__)["seed"]
    return helps


def _check_across_parts(c: Config):
    """The options of different parts that must agree."""
    if c.loop.profile_steps is not None:
        _check(c.outputs.log_dir is not None or c.outputs.save, "profile_steps needs log_dir, the TensorBoard folder "
               "the profile goes to (save=False writes none by default)")
    if c.loop.checkpoint_every_steps is not None:
        _check(c.outputs.save, "checkpoint_every_steps saves checkpoints within an epoch, and save=False writes none; "
               "drop one of them")


def _parse_gpus(gpus):
    if gpus is None or gpus == "":
        return None
    if isinstance(gpus, int) and not isinstance(gpus, bool):
        gpus = [gpus]
    if not isinstance(gpus, (str, list, tuple)):
        raise GpuparError(f"gpus={quote(gpus)}: give GPU indices as '0,1', [0, 1] or 0")
    items = gpus.split(",") if isinstance(gpus, str) else list(gpus)
    parsed = []
    for item in items:
        text = str(item).strip()
        if not text.isdigit():
            raise GpuparError(f"gpus={quote(gpus)}: {text!r} is not a GPU index; use e.g. gpus='0,1'")
        parsed.append(int(text))
    if len(set(parsed)) != len(parsed):
        raise GpuparError(f"gpus={quote(gpus)} names a GPU twice")
    return tuple(parsed)


def _parse_profile_steps(steps):
    if steps is None or steps == "":
        return None
    items = steps.split(",") if isinstance(steps, str) else steps
    hint = "give the first and last step to profile, e.g. profile_steps='20,40'"
    if not isinstance(items, (list, tuple)) or len(items) != 2:
        raise GpuparError(f"profile_steps={quote(steps)}: {hint}")
    try:
        first, last = (int(str(item).strip()) for item in items)
    except ValueError:
        raise GpuparError(f"profile_steps={quote(steps)}: not two whole numbers; {hint}") from None
    if not 1 <= first <= last:
        raise GpuparError(f"profile_steps={quote(steps)}: need 1 <= first <= last (steps count from 1); {hint}")
    return first, last


def _parse_stop_at(stop_at):
    if stop_at is None or stop_at == "" or stop_at == {}:
        return None
    hint = "give log names and targets, e.g. stop_at='val_accuracy=0.9' or {'val_accuracy': 0.9}"
    if isinstance(stop_at, str):
        pairs = [item.split("=", 1) for item in stop_at.split(",")]
        if any(len(pair) != 2 for pair in pairs):
            raise GpuparError(f"stop_at={stop_at!r}: {hint}")
        stop_at = {name.strip(): value for name, value in pairs}
    if not isinstance(stop_at, Mapping):
        raise GpuparError(f"stop_at={quote(stop_at)}: {hint}")
    try:
        return {str(name): float(value) for name, value in stop_at.items()}
    except (TypeError, ValueError):
        raise GpuparError(f"stop_at={quote(stop_at)}: a target is not a number; {hint}") from None


def _parse_stages(stages):
    if stages is None or stages == "" or stages == ():
        return None
    hint = "name the layers after which a new stage starts, e.g. stages='conv_out,dense_1' or [3, 7]"
    if isinstance(stages, (str, int)) and not isinstance(stages, bool):
        stages = str(stages).split(",")
    if not isinstance(stages, (list, tuple)):
        raise GpuparError(f"stages={quote(stages)}: {hint}")
    parsed = []
    for item in stages:
        if isinstance(item, bool) or not isinstance(item, (str, int)) or str(item).strip() == "":
            raise GpuparError(f"stages={quote(stages)}: {item!r} is not a layer name or index; {hint}")
        text = str(item).strip()
        parsed.append(int(text) if text.lstrip("-").isdigit() else text)
    return tuple(parsed)


def _parse_devices(devices):
    if devices is None or devices == "":
        return None
    if not isinstance(devices, (str, list, tuple)):
        raise GpuparError(f"devices={quote(devices)}: give device names as '/gpu:0,/gpu:1' or a list of them")
    items = devices.split(",") if isinstance(devices, str) else list(devices)
    names = tuple(str(d).strip() for d in items)
    for name in names:
        if not _DEVICE_NAME.match(name):
            raise GpuparError(
                f"devices={quote(devices)}: {name!r} is not a device name; use names like "
                "'/gpu:0' or '/cpu:1'"
            )
    return names


def quote(value) -> str:
    """A value as an error message shows it: repr for short values, type and shape for arrays and long ones."""
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, (str, bytes)):
        return f"<{type(value).__name__} of shape {tuple(shape)}>"
    if isinstance(value, (tuple, list)) and any(getattr(v, "shape", None) is not None for v in value):
        return f"({', '.join(quote(v) for v in value)})"
    text = repr(value)
    return text if len(text) <= 80 else f"<{type(value).__name__}: {text[:60]}...>"


def _check(condition, message):
    if not condition:
        raise GpuparError(message)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _can_create(path: str) -> bool:
    """True when path exists and is writable, or its nearest existing ancestor is a writable folder."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        return os.access(path, os.W_OK)
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return os.path.isdir(parent) and os.access(parent, os.W_OK)


def _check_resume(c: OutputOptions):
    _check(isinstance(c.resume, (bool, str)), f"resume={quote(c.resume)}: must be True, False or the path of a "
           "checkpoint")
    path = c.resume_path
    if path is not None:
        _check(os.path.exists(path + ".index"), f"resume={path!r}: no checkpoint there (expected {path}.index); give a "
               "path like model_dir/ckpt-3, or resume=True for the latest")
    if c.model_dir is not None and c.resume is False and c.save:
        _check(
            not any(os.path.exists(os.path.join(c.model_dir, *sub, "checkpoint")) for sub in ((), ("within_epoch",))),
            f"model_dir={quote(c.model_dir)} already holds checkpoints; pass resume=True (--resume) to "
            "continue from the latest, or choose an empty model_dir so nothing is overwritten",
        )
