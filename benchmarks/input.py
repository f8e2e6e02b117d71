"""Training images/s with augmentation on the host against on the device, in one run.

    python -m benchmarks.input                                   # about 3 minutes on 2 cores (make bench-input)
    python benchmarks/input.py --data_dir=/usr/share/datasets/fashion-mnist --json=runs/bench_input.json
    python -m benchmarks.input --steps=4 --repeats=1 --batch_size=64    # quick check

Each round runs `gpupar diagnose` (pipeline alone, step alone, both together) for no
augmentation, host augmentation and device augmentation, one after the other, so machine noise
hits the three alike; the table shows the median over rounds and the spread (min-max).
"""

import logging
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __package__ in (None, ""):  # run as a file, python benchmarks/input.py: the repository's root is the package's
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from benchmarks import script  # noqa: E402
from gpupar.errors import GpuparError  # noqa: E402
from gpupar.monitor.bottleneck import MIN_STEPS  # noqa: E402
from gpupar import diagnose_mnist  # noqa: E402

FLAGS = flags.FLAGS
PLACEMENTS = {"no augmentation": {}, "augment on host": dict(augment=True, augment_on="host"),
              "augment on device": dict(augment=True, augment_on="device")}
RATES = ("together_examples_per_second", "input_examples_per_second", "step_examples_per_second")


def define_flags():
    """Defines the flags (only when run: gpupar.cli has --data_dir and --batch_size too)."""
    flags.DEFINE_string("data_dir", None, f"Folder with the Fashion-MNIST IDX files; default {script.DEFAULT_DATA_DIR}.")
    flags.DEFINE_string("json", "runs/bench_input.json", "Write the results to this JSON file.")
    flags.DEFINE_integer("steps", 20, "Timed steps per measurement.", lower_bound=MIN_STEPS)
    flags.DEFINE_integer("repeats", 3, "Rounds over the three placements.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 1024, "Examples per step.", lower_bound=1)


def benchmark(data_dir, batch_size, steps, repeats) -> dict:
    """The run's settings, and per placement each round's rates, input wait and verdict (JSON-ready)."""
    results = {name: {key: [] for key in (*RATES, "input_wait_fraction")} for name in PLACEMENTS}
    verdicts = {name: [] for name in PLACEMENTS}
    for _ in range(repeats):
        for name, options in PLACEMENTS.items():
            report = diagnose_mnist(steps=steps, data_dir=data_dir, dataset="fashion_mnist", batch_size=batch_size,
                                    strategy="one_device", **options)
            for key in results[name]:
                results[name][key].append(getattr(report, key))
            verdicts[name].append(report.bound_by)
    return {"batch_size": batch_size, "steps": steps, "repeats": repeats, "results": results, "bound_by": verdicts}


def _verdicts(rounds) -> str:
    """'input pipeline 2/3' style: each verdict with the share of rounds that gave it."""
    return ", ".join(f"{v} {rounds.count(v)}/{len(rounds)}" for v in sorted(set(rounds), key=rounds.index))


def table(report) -> str:
    """The report as markdown, one row per placement, and the device/host ratio."""
    lines = ["| placement | training img/s (median, min-max) | pipeline alone | step alone | input wait | bound by |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, values in report["results"].items():
        together = values["together_examples_per_second"]
        lines.append(
            f"| {name} | {statistics.median(together):,.0f} ({min(together):,.0f}-{max(together):,.0f}) "
            f"| {statistics.median(values['input_examples_per_second']):,.0f} "
            f"| {statistics.median(values['step_examples_per_second']):,.0f} "
            f"| {statistics.median(values['input_wait_fraction']):.0%} | {_verdicts(report['bound_by'][name])} |")
    host, device = (statistics.median(report["results"][n]["together_examples_per_second"])
                    for n in ("augment on host", "augment on device"))
    lines += ["", f"augmentation on the device trains {device / host:.2f}x as fast as on the host."]
    return "\n".join(lines)


def main() -> int:
    """Runs the rounds, prints the table and writes JSON."""
    if not FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("gpupar").setLevel(logging.WARNING)  # diagnose's set-up lines, nine times over
    logging.getLogger("tensorflow").setLevel(logging.ERROR)  # each round traces new functions, by design
    try:
        report = benchmark(script.data_dir(FLAGS.data_dir), FLAGS.batch_size, FLAGS.steps, FLAGS.repeats)
    except GpuparError as e:
        print(f"benchmarks.input: error: {e}", file=sys.stderr)
        return 1
    print(table(report))
    if FLAGS.json:
        script.write_json(FLAGS.json, report)
    return 0


if __name__ == "__main__":
    script.run("benchmarks.input", define_flags, main)
