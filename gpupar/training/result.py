"""What a training run returns: per-epoch history and final metrics, also as JSON."""

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional

import numpy as np

from gpupar.errors import GpuparError


def format_logs(logs) -> str:
    """'loss: 0.6119, accuracy: 0.8012, val_loss: ...': a progress line's numbers, Keras' names (a vector in [])."""
    def shown(value):
        if np.ndim(value):  # a metric of several values (Precision at several thresholds)
            return f"[{', '.join(f'{v:.4f}' for v in np.ravel(value))}]"
        return f"{value:.4f}"

    return ", ".join(f"{name}: {shown(value)}" for name, value in logs.items())


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    """One epoch's numbers.

    Attributes:
      epoch: Epoch index, from 0 (ckpt-<epoch + 1> holds the state after it).
      logs: What Keras' model.fit logs for the epoch: "loss" and each metric over the epoch's training
        steps, and "val_loss" and "val_<metric>" on the whole evaluation set after it.
      seconds: Wall time of the epoch's training steps (in every run that trained them), evaluation excluded.
      examples_per_second: Training examples per second over the epoch.
      steps: Training steps in the epoch (with those of an earlier run, when it resumed mid-epoch).
      skipped_steps: Steps dropped for a non-finite loss or gradient (nan_policy=skip).
      input_wait_fraction: Share of step time spent waiting for input batches (see gpupar.monitor.bottleneck).
      gpu_util_percent: Mean NVML GPU-Util over the epoch and the GPUs; None where not sampled.
      gpu_memory_used_mb: Highest GPU memory in use on any GPU in the epoch; None where not sampled.
      resumed_at_step: The step this run resumed the epoch at (its sums carried over); 0 when it ran the whole epoch.
      updates_by_worker: Steps each worker applied, by worker index (parameter servers); None otherwise.
    """

    epoch: int
    logs: Dict[str, float]
    seconds: float
    examples_per_second: float
    steps: int
    skipped_steps: int = 0
    input_wait_fraction: float = 0.0
    gpu_util_percent: Optional[float] = None
    gpu_memory_used_mb: Optional[float] = None
    resumed_at_step: int = 0
    updates_by_worker: Optional[Dict[str, int]] = None

    @property
    def train_loss(self) -> float:
        """logs["loss"]."""
        return self.logs["loss"]

    @property
    def train_accuracy(self) -> Optional[float]:
        """logs["accuracy"], where the run has that metric."""
        return self.logs.get("accuracy")

    @property
    def test_accuracy(self) -> Optional[float]:
        """logs["val_accuracy"], where the run has evaluation data and that metric."""
        return self.logs.get("val_accuracy")


@dataclasses.dataclass
class FitResult:
    """The outcome of gpupar.fit or gpupar.fit_mnist: usable where model.fit's History is, with gpupar's records.

    Attributes:
      model: The trained Keras model, compiled: evaluate, predict and save work without a scope.
      strategy: The tf.distribute.Strategy its variables were made under.
      records: One EpochRecord per epoch trained in this run.
      history: As keras.callbacks.History.history: {"loss": [one per epoch], "val_loss": [...], ...}
        of this run, the logs as the callbacks left them (ReduceLROnPlateau adds learning_rate).
      logs: The final model's logs: the last epoch's, or a fresh evaluation when nothing was left to train.
      total_seconds: Wall time of the whole run, set-up included.
      strategy_description: The one-line description of the strategy that was chosen.
      replicas: Replicas whose shares of the batch make one update (data-parallel copies of the
        whole pipeline for model_parallel; 1 for parameter servers, whose workers update on their own).
      global_batch: Examples per step (one update) over those replicas.
      start_epoch: Epochs already done when this run started (more than 0 when resumed).
      checkpoint: Path of the last checkpoint written or restored, if any.
      workers: Parameter-server workers, each updating with its own batches (1 in every other mode).
    """

    model: Any
    strategy: Any
    records: List[EpochRecord]
    logs: Dict[str, float]
    total_seconds: float
    strategy_description: str
    replicas: int
    global_batch: int
    start_epoch: int
    checkpoint: Optional[str]
    history: Dict[str, List[Any]] = dataclasses.field(default_factory=dict)
    workers: int = 1

    @property
    def test_accuracy(self) -> Optional[float]:
        """logs["val_accuracy"]: the final model's accuracy on the evaluation set (the MNIST test set)."""
        return self.logs.get("val_accuracy")

    @property
    def epoch(self) -> List[int]:
        """As keras.callbacks.History.epoch: the epochs (from 0) trained in this run."""
        return [record.epoch for record in self.records]

    def metrics(self) -> dict:
        """Everything but the model and strategy objects, as plain JSON-able values."""
        return {
            "logs": dict(self.logs),
            "total_seconds": self.total_seconds,
            "strategy": self.strategy_description,
            "replicas": self.replicas,
            "workers": self.workers,
            "global_batch": self.global_batch,
            "start_epoch": self.start_epoch,
            "checkpoint": self.checkpoint,
            "history": [dataclasses.asdict(r) for r in self.records],
        }

    def save(self, path: str):
        """Writes the trained model as a .keras file that keras.models.load_model reads with Keras alone.

        gpupar's own layers become Keras' (gpupar.models.export), with the same weights and the same
        predictions.

        Raises:
          GpuparError: a path that does not end in .keras, or cannot be written.
        """
        from gpupar.models.export import save_model

        save_model(self.model, path)

    def write_json(self, path: str):
        """Writes metrics() to path, creating its folder.

        A resumed run keeps the earlier epochs that the file already holds, so the history in it
        covers the whole training, not only this run.
        """
        metrics = self.metrics()
        metrics["history"] = _earlier_epochs(path, self.start_epoch) + metrics["history"]
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(metrics, f, indent=2, default=_plain)
                f.write("\n")
            os.replace(path + ".tmp", path)  # never leaves a half-written file
        except OSError as e:
            raise GpuparError(f"{path}: cannot write the metrics ({e.strerror})") from None


def _plain(value):
    """A log's NumPy value (a metric of several values) as JSON takes it."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-able")


def _earlier_epochs(path: str, start_epoch: int) -> list:
    """The records of epochs before start_epoch from an existing metrics file, else []."""
    if start_epoch == 0 or not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            history = json.load(f).get("history", [])
        return [r for r in history if isinstance(r, dict) and r.get("epoch", start_epoch) < start_epoch]
    except (OSError, ValueError, AttributeError):
        return []
