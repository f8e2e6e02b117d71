"""The one frozen configuration shared by the Python API, the CLI flags and the tests.

Importing this module does not import TensorFlow, so every value is checked before any
TensorFlow work starts.
"""

import dataclasses
import os
import re
from typing import Mapping, Optional, Tuple, Union

from gpupar.errors import GpuparError

AUGMENT_PLACEMENTS = ("device", "host")
# The options of the MNIST presets (gpupar.fit_mnist), which gpupar.fit refuses.
MNIST_OPTIONS = ("dataset", "data_dir", "model", "dropout", "sync_batch_norm", "augment", "augment_on", "lstm_layers",
                 "lstm_units", "stop_at_accuracy")
STRATEGIES = ("auto", "one_device", "mirrored", "central_storage", "multi_worker_mirrored", "parameter_server")
# gpupar's own pipeline (gpupar/training/pipeline.py), not a tf.distribute strategy.
MODEL_PARALLEL = "model_parallel"
# The engines a run can need (gpupar.training.engine), by run_mode.
SYNCHRONOUS, PIPELINE, PARAMETER_SERVERS = "synchronous", "pipeline", "parameter servers"
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
      stop_at_accuracy: MNIST presets: stop after the first epoch whose test accuracy reaches this (e.g. 0.89); empty trains all epochs.
      stop_at: Stop after the first epoch whose logs reach these, e.g. "val_accuracy=0.9" (a loss: at or below); empty trains all epochs.
      batch_size: Examples per replica per step; the global batch is this times the replicas (and times accumulate_steps).
      accumulate_steps: Add up the gradients of this many batches on each replica, then all-reduce and update once: one step on an N-times larger batch, in the memory of one batch (synchronous strategies).
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
      metrics_json: Write the per-epoch history and final metrics to this JSON file, after every epoch; empty: model_dir/metrics.json (none with save=False).
      export_path: Save the trained model here as a .keras file that keras.models.load_model reads with Keras alone.
      augment: Randomly shift, rotate and zoom the training images.
      augment_on: Where augmentation runs: device (in the train step, batched) or host (tf.data, per image).
      num_parallel_calls: Threads for the tf.data map; empty lets tf.data tune it (AUTOTUNE).
      deterministic: Keep the exact example order; False lets a ready example overtake a slow one (no exact replay on resume).
      data_threads: Give tf.data a private pool of this many threads; empty uses TensorFlow's shared pool.
      profile_steps: Capture a TensorBoard profile of this run's steps FIRST,LAST (e.g. 20,40) into log_dir.
      model: convnet, or lstm (stacked LSTM over the 28 image rows).
      lstm_layers: LSTM layers of model=lstm; model_parallel puts each on its own device.
      lstm_units: Units in each LSTM layer of model=lstm.
      stages: model_parallel: the layers after which a new stage starts, by name or index, e.g. "conv_out,dense_1" or "3,7" (Sequential or single-chain models); empty for the MNIST presets' own split.
      microbatches: model_parallel: pipeline each replica's batch as this many micro-batches.
      precision: float32, mixed_bfloat16 (CPUs with bfloat16 units, TPUs) or mixed_float16 (GPUs; with dynamic loss scaling).
      jit_compile: Compile each train step with XLA (one replica only: tf.distribute's all-reduce cannot be compiled).
      intra_op_threads: Threads one op may use; empty lets gpupar choose from the cores and replicas, 0 leaves it to TensorFlow.
      inter_op_threads: Ops run at once; empty lets gpupar choose from the cores and replicas, 0 leaves it to TensorFlow.
      slurm_ps: Under SLURM, how many tasks are parameter servers (after task 0, the chief); 0 for synchronous.
      ps_shards: parameter_server: split each variable of 256 KiB or more into up to this many shards over the ps tasks (1: none); empty: one per ps task.
    """

    epochs: int = 5
    stop_at_accuracy: Optional[float] = None
    stop_at: Optional[Mapping[str, float]] = None
    batch_size: int = 1024
    accumulate_steps: int = 1
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
    export_path: Optional[str] = None
    augment: bool = False
    augment_on: str = "device"
    num_parallel_calls: Optional[int] = None
    deterministic: bool = True
    data_threads: Optional[int] = None
    profile_steps: Optional[Tuple[int, int]] = None
    model: str = "convnet"
    lstm_layers: int = 3
    lstm_units: int = 128
    stages: Optional[Tuple[Union[str, int], ...]] = None
    microbatches: int = 1
    precision: str = "float32"
    jit_compile: bool = False
    intra_op_threads: Optional[int] = None
    inter_op_threads: Optional[int] = None
    slurm_ps: int = 0
    ps_shards: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "gpus", _parse_gpus(self.gpus))
        object.__setattr__(self, "profile_steps", _parse_profile_steps(self.profile_steps))
        object.__setattr__(self, "devices", _parse_devices(self.devices))
        object.__setattr__(self, "stop_at", _parse_stop_at(self.stop_at))
        object.__setattr__(self, "stages", _parse_stages(self.stages))
        for name in ("data_dir", "model_dir", "log_dir", "metrics_json", "export_path"):
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

    def reached(self, logs) -> Optional[str]:
        """Why training should stop after an epoch with these logs (stop_at, stop_at_accuracy), or None."""
        targets = dict(self.stop_at or {})
        if self.stop_at_accuracy is not None:
            targets["val_accuracy"] = self.stop_at_accuracy
        for name, target in targets.items():
            value = logs.get(name)
            if value is not None and (value <= target if "loss" in name else value >= target):
                return f"{name} {value:.4f} reached {target}"
        return None

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


# Each field's own check: whole numbers with their least value, optional ones (None allowed),
# numbers in a range, booleans, and names from a list.
_WHOLE = {"epochs": 0, "batch_size": 1, "accumulate_steps": 1, "display_step": 1, "slurm_ps": 0, "lstm_layers": 1, "lstm_units": 1,
          "microbatches": 1}
_OPTIONAL_WHOLE = {"memory_limit_mb": 1, "virtual_cpus": 1, "max_to_keep": 1, "checkpoint_every_steps": 1,
                   "steps_per_epoch": 1, "num_parallel_calls": 1, "ps_shards": 1, "data_threads": 1, "steps_per_call": 1,
                   "intra_op_threads": 0, "inter_op_threads": 0}
_RANGES = {"learning_rate": ("a number > 0", lambda v: v > 0), "dropout": ("a rate in [0, 1)", lambda v: 0 <= v < 1),
           "stop_at_accuracy": ("an accuracy in (0, 1], e.g. 0.89", lambda v: 0 < v <= 1),
           "memory_fraction": ("a fraction in (0, 1]", lambda v: 0 < v <= 1)}
_BOOLEANS = ("memory_growth", "soft_placement", "log_placement", "save", "sync_batch_norm", "augment", "deterministic",
             "jit_compile")
_CHOICES = {"strategy": STRATEGY_CHOICES, "cross_device_ops": CROSS_DEVICE_OPS, "dataset": DATASETS,
            "nan_policy": NAN_POLICIES, "precision": PRECISIONS, "augment_on": AUGMENT_PLACEMENTS, "model": MODELS}
_THREADS_HINT = " (0 leaves it to TensorFlow), or empty to let gpupar choose"


def _validate(c: Config):
    """Each field on its own, then the fields that must agree, by topic; the mode's refusals last."""
    _validate_values(c)
    _validate_devices(c)
    _validate_data(c)
    _validate_outputs(c)
    check_mode(c, run_mode(c), decided=False)


def _validate_values(c: Config):
    _check(_is_int(c.seed), f"seed={quote(c.seed)}: must be a whole number")
    for name, least in {**_WHOLE, **_OPTIONAL_WHOLE}.items():
        value = getattr(c, name)
        if value is not None or name in _WHOLE:
            hint = _THREADS_HINT if name.endswith("_threads") else ""
            bound = "> 0" if least == 1 else f">= {least}"
            _check(_is_int(value) and value >= least, f"{name}={quote(value)}: must be a whole number {bound}{hint}")
    for name, (what, within) in _RANGES.items():
        value = getattr(c, name)
        if value is not None or name == "learning_rate":
            _check(_is_number(value) and within(value), f"{name}={quote(value)}: must be {what}")
    for name in _BOOLEANS:
        _check(isinstance(getattr(c, name), bool), f"{name}={quote(getattr(c, name))}: must be True or False")
    for name, choices in _CHOICES.items():
        value = getattr(c, name)
        _check(isinstance(value, str) and value in choices,
               f"{name}={quote(value)} is unknown; choose one of: {', '.join(choices)}")


def _validate_devices(c: Config):
    _check(c.memory_fraction is None or c.memory_limit_mb is None,
           "memory_fraction and memory_limit_mb both cap GPU memory; give only one of them")
    _check(not (c.precision == "mixed_float16" and c.nan_policy == "skip"),
           "precision=mixed_float16 already skips the steps whose gradients overflow (dynamic loss scaling); "
           "use it with nan_policy=stop")


def _validate_data(c: Config):
    if c.data_dir is not None:
        _check(os.path.isdir(c.data_dir), f"data_dir={quote(c.data_dir)} does not exist or is not a folder; point it "
               "at the folder holding train-images-idx3-ubyte[.gz] and the other three IDX files")


def _validate_outputs(c: Config):
    """Checkpoints, summaries, metrics, the exported model and resuming."""
    if c.export_path is not None:
        _check(c.export_path.endswith(".keras"), f"export_path={quote(c.export_path)}: Keras saves models as .keras "
               "files; give a path that ends in .keras")
    for name in ("log_dir", "metrics_json", "export_path"):
        path = getattr(c, name)
        if path is not None:
            _check(_can_create(path), f"{name}={quote(path)} cannot be written; choose a path in a folder you can write")
    if c.profile_steps is not None:
        _check(c.log_dir is not None or c.save, "profile_steps needs log_dir, the TensorBoard folder the profile goes "
               "to (save=False writes none by default)")
    if c.checkpoint_every_steps is not None:
        _check(c.save, "checkpoint_every_steps saves checkpoints within an epoch, and save=False writes none; drop "
               "one of them")
    _validate_resume(c)


def run_mode(config: Config, cluster=None) -> str:
    """Which engine a run needs: SYNCHRONOUS, PIPELINE (strategy=model_parallel) or PARAMETER_SERVERS.

    `cluster` (gpupar.runtime.cluster.Cluster): with strategy=auto, a cluster with ps tasks means
    parameter servers.
    """
    if config.strategy == MODEL_PARALLEL:
        return PIPELINE
    if config.strategy == "parameter_server" or (cluster is not None and cluster.num_ps):
        return PARAMETER_SERVERS
    return SYNCHRONOUS


def check_mode(c: Config, mode: str, decided: bool = True):
    """Refuses the options that `mode` does not run, rather than ignoring them: every mode refusal is here.

    Config checks its own strategy's mode when it is built (decided=False: strategy=auto may
    still become parameter_server in a cluster with ps tasks); a run checks again once its
    cluster has decided what strategy=auto means.
    """
    name = "parameter_server" if mode == PARAMETER_SERVERS else MODEL_PARALLEL
    if mode != PARAMETER_SERVERS and (decided or c.strategy != "auto"):
        _check(c.ps_shards is None, f"ps_shards={c.ps_shards} splits variables over the ps tasks of "
               "strategy=parameter_server; drop it, or train with parameter servers")
    if mode != PIPELINE:
        _check(c.microbatches == 1, f"microbatches={c.microbatches} pipelines the stages of strategy=model_parallel; "
               "pass strategy=model_parallel, or microbatches=1")
        _check(c.stages is None, f"stages={','.join(map(str, c.stages or ()))} splits a model for "
               "strategy=model_parallel; pass strategy=model_parallel, or no stages")
    if mode == SYNCHRONOUS:
        return
    _check(c.accumulate_steps == 1, f"accumulate_steps={c.accumulate_steps} adds up gradients in a synchronous step; "
           f"strategy={name} has steps of its own" + (" (it pipelines micro-batches with microbatches=N)"
                                                      if mode == PIPELINE else "") + "; use accumulate_steps=1")
    _check(not c.augment, f"augment is not available with strategy={name} (its input pipeline has no "
           "augmentation); drop --augment, or use a data-parallel strategy")
    _check(c.precision == "float32" and not c.jit_compile, f"precision and jit_compile are not available with "
           f"strategy={name} (its step is its own); use precision=float32 and no jit_compile")
    _check(c.nan_policy == "stop", f"nan_policy=skip drops a step on every replica at once; strategy={name} has no "
           "such step (use nan_policy=stop)")
    if mode == PIPELINE:
        _check(c.batch_size % c.microbatches == 0, f"batch_size={c.batch_size} does not split into microbatches="
               f"{c.microbatches} equal micro-batches; choose a batch_size that is a multiple of microbatches")
        _check(not c.sync_batch_norm, "sync_batch_norm synchronises tf.distribute replicas; strategy=model_parallel "
               "normalises each micro-batch on its own (as GPipe does); drop sync_batch_norm")
        return
    _check(c.model == "convnet", f"model={c.model} is not available with strategy=parameter_server, which "
           "trains the ConvNet; use model=convnet")
    _check(not c.sync_batch_norm, "sync_batch_norm needs replicas that step together; parameter_server updates "
           "asynchronously")
    for option in ("profile_steps", "checkpoint_every_steps"):
        _check(getattr(c, option) is None, f"{option} is not available with strategy=parameter_server (it saves "
               "after each epoch and on a signal); drop it")


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
