"""Where a run writes its checkpoints, TensorBoard logs and metrics when the config does not say.

By default every run gets a folder of its own, as Lightning's `lightning_logs/version_N` does: a
new numbered folder under runs/ (runs/001, runs/002, ...) with its checkpoints, `tensorboard/`
and `metrics.json`, so a first run keeps what it learnt and never overwrites an earlier one;
`resume=True` without a model_dir continues the latest of them. `plan_outputs` decides from the
output options and the folder names that exist (tests call it with made-up names);
`resolve_outputs` reads runs/ and applies the plan.
"""

import contextlib
import dataclasses
import logging
import os
import re
import shutil
from typing import Optional, Sequence

log = logging.getLogger("gpupar")
RUNS_DIR = "runs"
TENSORBOARD = "tensorboard"
METRICS = "metrics.json"
_NUMBERED = re.compile(r"^\d{3,}$")


@dataclasses.dataclass(frozen=True)
class RunFolders:
    """Where one run writes.

    Attributes:
      model_dir: Checkpoint folder (also read from on resume), or None.
      log_dir: TensorBoard folder, or None.
      metrics_json: Metrics file, or None.
      warning: Something the user should know about the choice (e.g. nothing to resume), or None.
    """

    model_dir: Optional[str]
    log_dir: Optional[str]
    metrics_json: Optional[str]
    warning: Optional[str] = None


def plan_outputs(outputs, existing: Sequence[str], runs_dir: str = RUNS_DIR, chief: bool = True) -> RunFolders:
    """The folders of a run with these OutputOptions, given the names of the folders now in runs_dir.

    A cluster's other tasks (not `chief`) keep nothing (gpupar.training.multi_worker): they only read the
    run folder the chief resumes from.
    """
    numbers = sorted(int(name) for name in existing if _NUMBERED.match(name))
    model_dir, warning = outputs.model_dir, None
    if not chief:
        latest = os.path.join(runs_dir, f"{numbers[-1]:03d}") if outputs.resume is True and numbers else None
        return RunFolders(model_dir or latest, None, None)
    if model_dir is None:
        if outputs.resume is True and numbers:
            model_dir = os.path.join(runs_dir, f"{numbers[-1]:03d}")
        elif outputs.save:
            model_dir = os.path.join(runs_dir, f"{(numbers[-1] + 1 if numbers else 1):03d}")
            if outputs.resume is True:
                warning = f"resume: no earlier run under {runs_dir}/, so this run starts from scratch in {model_dir}"
    defaults = outputs.save and model_dir is not None
    return RunFolders(
        model_dir=model_dir,
        log_dir=outputs.log_dir or (os.path.join(model_dir, TENSORBOARD) if defaults else None),
        metrics_json=outputs.metrics_json or (os.path.join(model_dir, METRICS) if defaults else None),
        warning=warning,
    )


def resolve_outputs(outputs, chief: bool = True):
    """The OutputOptions with their folders filled in (plan_outputs on this machine's runs/)."""
    existing = os.listdir(RUNS_DIR) if os.path.isdir(RUNS_DIR) else []
    folders = plan_outputs(outputs, existing, chief=chief)
    if folders.warning:
        log.warning(folders.warning)
    if chief and outputs.resume is True and outputs.model_dir and not os.path.isdir(outputs.model_dir):
        log.warning("resume: model_dir=%r does not exist (check the path), so this run starts from scratch there",
                    outputs.model_dir)
    return dataclasses.replace(outputs, model_dir=folders.model_dir, log_dir=folders.log_dir,
                               metrics_json=folders.metrics_json)


def describe_outputs(outputs, checkpoint: Optional[str]) -> str:
    """The run's last line about its files: where checkpoints, TensorBoard logs and metrics went."""
    parts = []
    if outputs.save and outputs.model_dir is not None:
        parts.append(f"checkpoints in {outputs.model_dir}" + (f" (latest {checkpoint})" if checkpoint else ""))
    if outputs.log_dir is not None:
        parts.append(f"TensorBoard: tensorboard --logdir {outputs.log_dir}")
    if outputs.metrics_json is not None:
        parts.append(f"metrics: {outputs.metrics_json}")
    return "outputs: " + ("; ".join(parts) if parts else "none written (save=False)")


@contextlib.contextmanager
def left_clean_on_error(model_dir: Optional[str]):
    """While open, a run that fails before its first checkpoint removes the folders it made (model_dir, runs/).

    Bad input found only when the step is first traced (a model with no loss at all, as Keras'
    compute_loss finds it) must leave nothing behind, as the checks before it do; a folder that
    existed before the run, or holds a checkpoint, is kept.
    """
    made = []
    folder = os.path.abspath(model_dir) if model_dir else None
    while folder and not os.path.exists(folder):
        made.append(folder)
        folder = os.path.dirname(folder)
    try:
        yield
    except Exception:
        if made and not any("checkpoint" in files for _, _, files in os.walk(made[0])):
            shutil.rmtree(made[-1], ignore_errors=True)
        raise
