"""The one frozen configuration shared by the Python API, the CLI flags and the tests.

Importing this module does not import TensorFlow, so every value is checked before any
TensorFlow work starts.
"""

import dataclasses
import os
import re
from typing import Optional, Tuple, Union

from gpupar.errors import GpuparError

AUGMENT_PLACEMENTS = ("device", "host")
STRATEGIES = ("auto", "one_device", "mirrored", "central_storage", "multi_worker_mirrored", "parameter_server")
# gpupar's own pipeline (gpupar/model_parallel.py), not a tf.distribute strategy.
MODEL_PARALLEL = "model_parallel"
STRATEGY_CHOICES = (*STRATEGIES, MODEL_PARALLEL)
MODELS = ("convnet", "lstm")
CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduction_to_one_device")
DATASETS = ("mnist", "fashion_mnist")
NAN_POLICIES = ("stop", "skip")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
_DEVICE_NAME = re.compile(r"^/(device:)?(cpu|gpu):\d+$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything one training run needs.

    Attributes:
      epochs: Total epochs to train; a resumed run stops at the same total.
      stop_at_accuracy: Stop after the first epoch whose test accuracy reaches this (e.g. 0.89); empty trains all epochs.
      batch_size: Examples per replica per step; the global batch is this times the replicas.
      learning_rate: Adam learning rate.
      strategy: auto, one_device, mirrored, central_storage, multi_worker_mirrored, parameter_server or model_parallel.
      devices: Device names overriding detection, e.g. "/gpu:0,/gpu:1".
      cross_device_ops: All-reduce: auto, nccl, hierarchical_copy or reduction_to_one_device.
      gpus: GPU indices to make visible, e.g. "0,1" (like CUDA_VISIBLE_DEVICES); empty for all.
      memory_growth: Allocate GPU memory as needed instead of all at once (TF1 allow_growth).
      memory_limit_mb: Cap each visible GPU at this many MiB.
      memory_fraction: Cap each visible GPU at this fraction of its memory (TF1 per_process_gpu_memory_fraction).
      soft_placement: Run ops that have no kernel on the requested device somewhere else.
      log_placement: Log the device every op runs on.
      virtual_cpus: Split the CPU into this many logical devices, for multi-device runs without GPUs.
      dataset: TFDS dataset: mnist or fashion_mnist.
      data_dir: Folder with the four MNIST-format IDX files (gzipped or not); empty loads from TFDS.
      model_dir: Folder of this run: its checkpoints, and by default its TensorBoard logs and metrics; empty: a new numbered folder under runs/ (runs/001, ...; with resume, the latest).
      save: Write checkpoints, and by default TensorBoard logs and metrics, into model_dir; False writes no checkpoint, and only the log_dir and metrics_json given.
      resume: True continues from the latest checkpoint in model_dir (empty model_dir: the latest run under runs/); a path restores that checkpoint.
      max_to_keep: Checkpoints kept in model_dir; empty keeps all.
      checkpoint_every_steps: Also save within an epoch every this many steps; empty saves per epoch only.
      log_dir: TensorBoard folder; empty: model_dir/tensorboard (none with save=False).
      display_step: Print a progress line every this many steps.
      steps_per_call: Train steps run inside one tf.function call; empty runs display_step steps per call (capped at the epoch), so the host reads results once per progress line.
      nan_policy: A step with a NaN or Inf loss or gradient: stop (error, last checkpoint kept) or skip it.
      dropout: Dropout rate before the last layer.
      sync_batch_norm: Batch-norm statistics over the global batch rather than each replica's.
      seed: Seed for weights, shuffling and dropout.
      steps_per_epoch: Cap on the steps of each epoch, for quick runs; empty for a full pass.
      metrics_json: Write the per-epoch history and final metrics to this JSON file; empty: model_dir/metrics.json (none with save=False).
      augment: Randomly shift, rotate and zoom the training images.
      augment_on: Where augmentation runs: device (in the train step, batched) or host (tf.data, per image).
      num_parallel_calls: Threads for the tf.data map; empty lets tf.data tune it (AUTOTUNE).
      deterministic: Keep the exact example order; False lets a ready example overtake a slow one (no exact replay on resume).
      data_threads: Give tf.data a private pool of this many threads; empty uses TensorFlow's shared pool.
      profile_steps: Capture a TensorBoard profile of this run's steps FIRST,LAST (e.g. 20,40) into log_dir.
      model: convnet, or lstm (stacked LSTM over the 28 image rows).
      lstm_layers: LSTM layers of model=lstm; model_parallel puts each on its own device.
      lstm_units: Units in each LSTM layer of model=lstm.
      microbatches: model_parallel: pipeline each replica's batch as this many micro-batches.
      precision: float32, mixed_bfloat16 (CPUs with bfloat16 units, TPUs) or mixed_float16 (GPUs; with dynamic loss scaling).
      jit_compile: Compile each train step with XLA (one replica only: tf.distribute's all-reduce cannot be compiled).
      intra_op_threads: Threads one op may use; empty lets gpupar choose from the cores and replicas, 0 leaves it to TensorFlow.
      inter_op_threads: Ops run at once; empty lets gpupar choose from the cores and replicas, 0 leaves it to TensorFlow.
      slurm_ps: Under SLURM, how many tasks are parameter servers (after task 0, the chief); 0 for synchronous.
    """

    epochs: int = 5
    stop_at_accuracy: Optional[float] = None
    batch_size: int = 1024
    learning_rate: float = 1e-3
    strategy: str = "auto"
    devices: Optional[Tuple[str, ...]] = None
    cross_device_ops: str = "auto"
    gpus: Optional[Tuple[int, ...]] = None
    memory_growth: bool = False
    memory_limit_mb: Optional[int] = None
    memory_fraction: Optional[float] = None
    soft_placement: bool = True
    log_placement: bool = False
    virtual_cpus: Optional[int] = None
    dataset: str = "mnist"
    data_dir: Optional[str] = None
    model_dir: Optional[str] = None
    save: bool = True
    resume: Union[bool, str] = False
    max_to_keep: Optional[int] = None
    checkpoint_every_steps: Optional[int] = None
    log_dir: Optional[str] = None
    display_step: int = 10
    steps_per_call: Optional[int] = None
    nan_policy: str = "stop"
    dropout: float = 0.5
    sync_batch_norm: bool = False
    seed: int = 0
    steps_per_epoch: Optional[int] = None
    metrics_json: Optional[str] = None
    augment: bool = False
    augment_on: str = "device"
    num_parallel_calls: Optional[int] = None
    deterministic: bool = True
    data_threads: Optional[int] = None
    profile_steps: Optional[Tuple[int, int]] = None
    model: str = "convnet"
    lstm_layers: int = 3
    lstm_units: int = 128
    microbatches: int = 1
    precision: str = "float32"
    jit_compile: bool = False
    intra_op_threads: Optional[int] = None
    inter_op_threads: Optional[int] = None
    slurm_ps: int = 0

    def __post_init__(self):
        object.__setattr__(self, "gpus", _parse_gpus(self.gpus))
        object.__setattr__(self, "profile_steps", _parse_profile_steps(self.profile_steps))
        object.__setattr__(self, "devices", _parse_devices(self.devices))
        for name in ("data_dir", "model_dir", "log_dir", "metrics_json"):
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)
        if self.resume in ("", None):
            object.__setattr__(self, "resume", False)
        _validate(self)

    @classmethod
    def from_options(cls, base: Optional["Config"] = None, **options) -> "Config":
        """A Config from keyword options over `base` (or the defaults); unknown options are errors."""
        unknown = sorted(set(options) - set(field_names()))
        if unknown:
            raise GpuparError(
                f"unknown option(s) {', '.join(unknown)}; valid options are: "
                f"{', '.join(field_names())}"
            )
        return dataclasses.replace(base, **options) if base is not None else cls(**options)

    def steps_in_a_call(self, steps_per_epoch: int) -> int:
        """Train steps per tf.function call: steps_per_call, else display_step capped at the epoch."""
        return self.steps_per_call or min(self.display_step, steps_per_epoch)

    def reached_target(self, test_accuracy: float) -> bool:
        """Whether training should stop here, having reached stop_at_accuracy."""
        return self.stop_at_accuracy is not None and test_accuracy >= self.stop_at_accuracy

    @property
    def resume_path(self) -> Optional[str]:
        """The checkpoint path given as `resume`, or None when resume is True/False."""
        return self.resume if isinstance(self.resume, str) else None


def field_names():
    """The names of all Config fields, in declaration order."""
    return [f.name for f in dataclasses.fields(Config)]


def field_help():
    """Maps each field name to its one-line help from the Attributes docstring."""
    helps = {}
    in_attributes = False
    for line in Config.__doc__.splitlines():
        stripped = line.strip()
        if stripped == "Attributes:":
            in_attributes = True
        elif in_attributes and ":" in stripped:
            name, text = stripped.split(":", 1)
            helps[name] = text.strip()
    return helps


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


def _positive_int(config, name, optional=False):
    value = getattr(config, name)
    if optional and value is None:
        return
    _check(_is_int(value) and value > 0, f"{name}={quote(value)}: must be a whole number > 0")


def _validate(c: Config):
    _check(_is_int(c.epochs) and c.epochs >= 0, f"epochs={quote(c.epochs)}: must be a whole number >= 0")
    for name in ("batch_size", "display_step"):
        _positive_int(c, name)
    for name in ("memory_limit_mb", "virtual_cpus", "max_to_keep", "checkpoint_every_steps", "steps_per_epoch",
                 "num_parallel_calls", "data_threads", "steps_per_call"):
        _positive_int(c, name, optional=True)
    for name in ("intra_op_threads", "inter_op_threads"):
        value = getattr(c, name)
        _check(value is None or _is_int(value) and value >= 0,
               f"{name}={quote(value)}: must be a whole number >= 0 (0 leaves it to TensorFlow), or empty to let gpupar choose")
    _check(_is_int(c.seed), f"seed={quote(c.seed)}: must be a whole number")
    _check(_is_int(c.slurm_ps) and c.slurm_ps >= 0, f"slurm_ps={quote(c.slurm_ps)}: must be a whole number >= 0")
    _check(
        _is_number(c.learning_rate) and c.learning_rate > 0,
        f"learning_rate={quote(c.learning_rate)}: must be a number > 0",
    )
    _check(
        _is_number(c.dropout) and 0 <= c.dropout < 1,
        f"dropout={quote(c.dropout)}: must be a rate in [0, 1)",
    )
    _check(
        isinstance(c.strategy, str) and c.strategy in STRATEGY_CHOICES,
        f"strategy={quote(c.strategy)} is unknown; choose one of: {', '.join(STRATEGY_CHOICES)}",
    )
    _check(
        isinstance(c.cross_device_ops, str) and c.cross_device_ops in CROSS_DEVICE_OPS,
        f"cross_device_ops={quote(c.cross_device_ops)} is unknown; choose one of: "
        f"{', '.join(CROSS_DEVICE_OPS)}",
    )
    _check(
        isinstance(c.dataset, str) and c.dataset in DATASETS,
        f"dataset={quote(c.dataset)} is unknown; choose one of: {', '.join(DATASETS)}",
    )
    _check(
        isinstance(c.nan_policy, str) and c.nan_policy in NAN_POLICIES,
        f"nan_policy={quote(c.nan_policy)} is unknown; choose one of: {', '.join(NAN_POLICIES)}",
    )
    if c.stop_at_accuracy is not None:
        _check(_is_number(c.stop_at_accuracy) and 0 < c.stop_at_accuracy <= 1,
               f"stop_at_accuracy={quote(c.stop_at_accuracy)}: must be an accuracy in (0, 1], e.g. 0.89")
    if c.memory_fraction is not None:
        _check(
            _is_number(c.memory_fraction) and 0 < c.memory_fraction <= 1,
            f"memory_fraction={quote(c.memory_fraction)}: must be a fraction in (0, 1]",
        )
        _check(
            c.memory_limit_mb is None,
            "memory_fraction and memory_limit_mb both cap GPU memory; give only one of them",
        )
    _check(
        isinstance(c.precision, str) and c.precision in PRECISIONS,
        f"precision={quote(c.precision)} is unknown; choose one of: {', '.join(PRECISIONS)}",
    )
    _check(
        not (c.precision == "mixed_float16" and c.nan_policy == "skip"),
        "precision=mixed_float16 already skips the steps whose gradients overflow (dynamic loss scaling); "
        "use it with nan_policy=stop",
    )
    _check(
        isinstance(c.augment_on, str) and c.augment_on in AUGMENT_PLACEMENTS,
        f"augment_on={quote(c.augment_on)} is unknown; choose one of: {', '.join(AUGMENT_PLACEMENTS)}",
    )
    if c.profile_steps is not None:
        _check(c.log_dir is not None or c.save, "profile_steps needs log_dir, the TensorBoard folder the profile goes "
               "to (save=False writes none by default)")
    for name in ("memory_growth", "soft_placement", "log_placement", "sync_batch_norm", "augment", "deterministic",
                 "jit_compile", "save"):
        _check(isinstance(getattr(c, name), bool), f"{name}={getattr(c, name)!r}: must be True or False")
    if c.data_dir is not None:
        _check(
            os.path.isdir(c.data_dir),
            f"data_dir={quote(c.data_dir)} does not exist or is not a folder; point it at the folder "
            "holding train-images-idx3-ubyte[.gz] and the other three IDX files",
        )
    for name in ("log_dir", "metrics_json"):
        path = getattr(c, name)
        if path is not None:
            _check(_can_create(path), f"{name}={path!r} cannot be written; choose a path in a folder you can write")
    if c.checkpoint_every_steps is not None:
        _check(c.save, "checkpoint_every_steps saves checkpoints within an epoch, and save=False writes none; drop "
               "one of them")
    _validate_resume(c)
    _validate_mode_options(c)
    _validate_model(c)


def _validate_mode_options(c: Config):
    """Options that a mode with a loop of its own does not run, refused rather than ignored."""
    if c.strategy in (MODEL_PARALLEL, "parameter_server"):
        _check(not c.augment, f"augment is not available with strategy={c.strategy} (its input pipeline has no "
               "augmentation); drop --augment, or use a data-parallel strategy")
        _check(c.precision == "float32" and not c.jit_compile, f"precision and jit_compile are not available with "
               f"strategy={c.strategy} (its step is its own); use precision=float32 and no jit_compile")
    if c.strategy == "parameter_server":
        _check(c.model == "convnet", f"model={c.model} is not available with strategy=parameter_server, which "
               "trains the ConvNet; use model=convnet")
        for name in ("profile_steps", "checkpoint_every_steps"):
            _check(getattr(c, name) is None, f"{name} is not available with strategy=parameter_server (it saves "
                   "after each epoch and on a signal); drop it")


def _validate_model(c: Config):
    _check(isinstance(c.model, str) and c.model in MODELS, f"model={quote(c.model)} is unknown; choose one of: {', '.join(MODELS)}")
    for name in ("lstm_layers", "lstm_units", "microbatches"):
        _positive_int(c, name)
    if c.strategy != MODEL_PARALLEL:
        _check(c.microbatches == 1, f"microbatches={c.microbatches} pipelines the stages of strategy=model_parallel; "
               "pass strategy=model_parallel, or microbatches=1")
        return
    _check(c.batch_size % c.microbatches == 0, f"batch_size={c.batch_size} does not split into microbatches="
           f"{c.microbatches} equal micro-batches; choose a batch_size that is a multiple of microbatches")
    _check(c.nan_policy == "stop", "nan_policy=skip is not available with strategy=model_parallel; use nan_policy=stop")
    _check(not c.sync_batch_norm, "sync_batch_norm synchronises tf.distribute replicas; strategy=model_parallel "
           "normalises each micro-batch on its own (as GPipe does); drop sync_batch_norm")


def _can_create(path: str) -> bool:
    """True when path exists and is writable, or its nearest existing ancestor is a writable folder."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        return os.access(path, os.W_OK)
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return os.path.isdir(parent) and os.access(parent, os.W_OK)


def _validate_resume(c: Config):
    _check(
        isinstance(c.resume, (bool, str)),
        f"resume={quote(c.resume)}: must be True, False or the path of a checkpoint",
    )
    path = c.resume_path
    if path is not None:
        _check(
            os.path.exists(path + ".index"),
            f"resume={path!r}: no checkpoint there (expected {path}.index); give a path like "
            "model_dir/ckpt-3, or resume=True for the latest",
        )
    if c.model_dir is not None and c.resume is False and c.save:
        _check(
            not any(os.path.exists(os.path.join(c.model_dir, *sub, "checkpoint")) for sub in ((), ("within_epoch",))),
            f"model_dir={quote(c.model_dir)} already holds checkpoints; pass resume=True (--resume) to "
            "continue from the latest, or choose an empty model_dir so nothing is overwritten",
        )
