"""What a training run returns: per-epoch history and final metrics, also as JSON."""

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional

from gpupar.errors import GpuparError


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    """One epoch's numbers.

    Attributes:
      epoch: Epoch index, from 0 (ckpt-<epoch + 1> holds the state after it).
      train_loss: Mean training loss (cross-entropy plus L2) over the epoch's steps.
      train_accuracy: Training accuracy over the epoch's steps (dropout on).
      test_accuracy: Accuracy on the whole test set after the epoch.
      seconds: Wall time of the epoch's training steps (in every run that trained them), evaluation excluded.
      images_per_second: Training images per second over the epoch.
      steps: Training steps in the epoch (with those of an earlier run, when it resumed mid-epoch).
      skipped_steps: Steps dropped for a non-finite loss or gradient (nan_policy=skip).
      input_wait_fraction: Share of step time spent waiting for input batches (see gpupar.monitor.bottleneck).
      gpu_util_percent: Mean NVML GPU-Util over the epoch and the GPUs; None where not sampled.
      gpu_memory_used_mb: Highest GPU memory in use on any GPU in the epoch; None where not sampled.
      resumed_at_step: The step this run resumed the epoch at (its sums carried over); 0 when it ran the whole epoch.
      updates_by_worker: Steps each worker applied, by worker index (parameter servers); None otherwise.
    """

    epoch: int
    train_loss: float
    train_accuracy: float
    test_accuracy: float
    seconds: float
    images_per_second: float
    steps: int
    skipped_steps: int = 0
    input_wait_fraction: float = 0.0
    gpu_util_percent: Optional[float] = None
    gpu_memory_used_mb: Optional[float] = None
    resumed_at_step: int = 0
    updates_by_worker: Optional[Dict[str, int]] = None


@dataclasses.dataclass
class FitResult:
    """The outcome of fit_mnist.

    Attributes:
      model: The trained Keras model.
      strategy: The tf.distribute.Strategy it was trained with (the StagePlan for model_parallel).
      history: One EpochRecord per epoch trained in this run.
      test_accuracy: Test accuracy of the final model.
      total_seconds: Wall time of the whole run, set-up included.
      strategy_description: The one-line description of the strategy that was chosen.
      replicas: Number of replicas (data-parallel copies of the whole pipeline for model_parallel).
      global_batch: Examples per step over all replicas.
      start_epoch: Epochs already done when this run started (more than 0 when resumed).
      checkpoint: Path of the last checkpoint written or restored, if any.
    """

    model: Any
    strategy: Any
    history: List[EpochRecord]
    test_accuracy: float
    total_seconds: float
    strategy_description: str
    replicas: int
    global_batch: int
    start_epoch: int
    checkpoint: Optional[str]

    def metrics(self) -> dict:
        """Everything but the model and strategy objects, as plain JSON-able values."""
        return {
            "test_accuracy": self.test_accuracy,
            "total_seconds": self.total_seconds,
            "strategy": self.strategy_description,
            "replicas": self.replicas,
            "global_batch": self.global_batch,
            "start_epoch": self.start_epoch,
            "checkpoint": self.checkpoint,
            "history": [dataclasses.asdict(r) for r in self.history],
        }

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
                json.dump(metrics, f, indent=2)
                f.write("\n")
            os.replace(path + ".tmp", path)  # never leaves a half-written file
        except OSError as e:
            raise GpuparError(f"{path}: cannot write the metrics ({e.strerror})") from None


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
