"""`gpupar plot metrics.json -o curves.png`: training curves from a --metrics_json file, headless."""

import json

from gpupar.errors import GpuparError

FIELDS = ("epoch", "train_loss", "train_accuracy", "test_accuracy", "images_per_second")
WIDTH, HEIGHT, DPI = 1200, 400, 100


def load_history(path: str):
    """The per-epoch history of a metrics file, checked for the fields the plot needs."""
    try:
        with open(path) as f:
            metrics = json.load(f)
    except OSError as e:
        raise GpuparError(f"{path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise GpuparError(f"{path}: not JSON ({e.msg} at line {e.lineno}); write it with --metrics_json") from None
    history = metrics.get("history") if isinstance(metrics, dict) else None
    if not isinstance(history, list) or not history:
        raise GpuparError(f"{path}: no per-epoch 'history' list; write it with gpupar --metrics_json=PATH")
    for i, record in enumerate(history):
        missing = [f for f in FIELDS if not isinstance(record, dict) or not isinstance(record.get(f), (int, float))]
        if missing:
            raise GpuparError(f"{path}: history[{i}] lacks number(s) {', '.join(missing)}")
    return history


def plot_history(history, output: str):
    """Writes loss, train/test accuracy and images/s per epoch as one PNG of WIDTH x HEIGHT pixels."""
    try:
        import matplotlib
    except ImportError:
        raise GpuparError("gpupar plot needs matplotlib: pip install 'gpupar[plot]'") from None
    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot as plt

    epochs = [r["epoch"] for r in history]
    figure, (loss, accuracy, speed) = plt.subplots(1, 3, figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)
    loss.plot(epochs, [r["train_loss"] for r in history], marker="o")
    loss.set(title="train loss", xlabel="epoch")
    accuracy.plot(epochs, [r["train_accuracy"] for r in history], marker="o", label="train")
    accuracy.plot(epochs, [r["test_accuracy"] for r in history], marker="o", label="test")
    accuracy.set(title="accuracy", xlabel="epoch")
    accuracy.legend()
    speed.plot(epochs, [r["images_per_second"] for r in history], marker="o")
    speed.set(title="training images/s", xlabel="epoch")
    for axes in (loss, accuracy, speed):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    try:
        figure.savefig(output, dpi=DPI)
    except OSError as e:
        raise GpuparError(f"{output}: cannot write the plot ({e.strerror})") from None
    finally:
        plt.close(figure)
