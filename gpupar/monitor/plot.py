"""`gpupar plot metrics.json -o curves.png`: training curves from a --metrics_json file, headless."""

import json

from gpupar.errors import GpuparError

FIELDS = ("epoch", "train_loss", "train_accuracy", "test_accuracy", "images_per_second")
WIDTH, HEIGHT, DPI = 1200, 400, 100


def load_history(path: str):
    """The per-epoch history of a metrics file, checked for the fields the plot needs, and the run's title."""
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
    strategy = str(metrics.get("strategy", "")).split(";")[0].replace("strategy: ", "")
    return history, f"{path}: {strategy}" if strategy else path


def draw_history(history, title: str = ""):
    """A matplotlib Figure of WIDTH x HEIGHT pixels: loss, train/test accuracy and images/s per epoch.

    An epoch that a resumed run finished is drawn as a whole epoch: its record carries the sums of
    both runs (EpochRecord.resumed_at_step).
    """
    try:
        import matplotlib
    except ImportError:
        raise GpuparError("gpupar plot needs matplotlib: pip install 'gpupar[plot]'") from None
    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [r["epoch"] for r in history]
    figure, (loss, accuracy, speed) = plt.subplots(1, 3, figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI)
    loss.plot(epochs, [r["train_loss"] for r in history], marker="o")
    loss.set(title="train loss", xlabel="epoch", ylabel="loss")
    accuracy.plot(epochs, [r["train_accuracy"] for r in history], marker="o", label="train")
    accuracy.plot(epochs, [r["test_accuracy"] for r in history], marker="o", label="test")
    accuracy.set(title="accuracy", xlabel="epoch", ylabel="accuracy")
    accuracy.legend()
    speed.plot(epochs, [r["images_per_second"] for r in history], marker="o")
    speed.set(title="training speed", xlabel="epoch", ylabel="images/s")
    for axes in (loss, accuracy, speed):
        axes.grid(alpha=0.3)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs only
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return figure


def plot_history(history, output: str, title: str = ""):
    """Writes draw_history's figure as a PNG to `output`."""
    figure = draw_history(history, title)
    from matplotlib import pyplot as plt

    try:
        figure.savefig(output, dpi=DPI)
    except OSError as e:
        raise GpuparError(f"{output}: cannot write the plot ({e.strerror})") from None
    finally:
        plt.close(figure)
