"""`gpupar plot metrics.json -o curves.png`: curves of every log from a metrics file, headless."""

import json

from gpupar.errors import GpuparError

FIELDS = ("epoch", "examples_per_second")
WIDTH, HEIGHT, DPI = 1200, 400, 100


def load_history(path: str):
    """The per-epoch history of a metrics file, checked for what the plot needs, and the run's title."""
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
        logs = record.get("logs") if isinstance(record, dict) else None
        if not isinstance(logs, dict) or not isinstance(logs.get("loss"), (int, float)):
            missing.append("logs.loss")
        if missing:
            raise GpuparError(f"{path}: history[{i}] lacks number(s) {', '.join(missing)}")
    strategy = str(metrics.get("strategy", "")).split(";")[0].replace("strategy: ", "")
    return history, f"{path}: {strategy}" if strategy else path


def _panels(history):
    """[(title, [log names])]: the losses, then each metric with its val_ twin, in the logs' order."""
    names = list(dict.fromkeys(name for record in history for name in record["logs"]))
    trained = [name for name in names if not name.startswith("val_")]
    panels = [(name, [n for n in (name, f"val_{name}") if n in names]) for name in trained]
    panels += [(name, [name]) for name in names if name.startswith("val_") and name[4:] not in trained]
    return panels


def draw_history(history, title: str = ""):
    """A matplotlib Figure of WIDTH x HEIGHT pixels: each log per epoch (training and evaluation), and the speed.

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
    panels = _panels(history)
    figure, axes = plt.subplots(1, len(panels) + 1, figsize=(WIDTH / DPI, HEIGHT / DPI), dpi=DPI, squeeze=False)
    for (name, names), panel in zip(panels, axes[0]):
        for log_name in names:
            values = [r["logs"].get(log_name, float("nan")) for r in history]
            panel.plot(epochs, values, marker="o", label="evaluation" if log_name.startswith("val_") else "training")
        panel.set(title=name, xlabel="epoch", ylabel=name)
        panel.legend()
    speed = axes[0][-1]
    speed.plot(epochs, [r["examples_per_second"] for r in history], marker="o")
    speed.set(title="training speed", xlabel="epoch", ylabel="examples/s")
    for panel in axes[0]:
        panel.grid(alpha=0.3)
        panel.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs only
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
