"""Training throughput of gpupar's own loop against Keras model.fit, side by side.

    python -m gpupar.bench                                          # about 3 minutes on 2 cores
    python -m gpupar.bench --data_dir=/usr/share/datasets/fashion-mnist --json=runs/bench.json
    python -m gpupar.bench --steps=3 --repeats=1 --batch_size=64    # quick check

For 1 replica (OneDeviceStrategy on /cpu:0) and 2 replicas (MirroredStrategy over 2 virtual
CPUs) it times steady-state training images/s of gpupar's loop (1 and 10 steps per call) and of
model.fit, with the same model, input pipeline and strategy, and prints a table and writes JSON.
Warm-up (tracing) steps are discarded. For each strategy, every round runs gpupar K=1, gpupar
K=10 and one model.fit epoch, so machine noise hits them alike; the two strategies run one
after the other.
"""

import json
import math
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402  (the environment variable must come first)
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from gpupar import data  # noqa: E402
from gpupar.config import Config  # noqa: E402
from gpupar.devices import configure_devices  # noqa: E402
from gpupar.errors import GpuparError  # noqa: E402
from gpupar.model import build_convnet  # noqa: E402
from gpupar.strategy import build_strategy, detected_plan  # noqa: E402
from gpupar.teardown import exit_without_teardown, keep_for_process  # noqa: E402
from gpupar.train import make_train_function  # noqa: E402

FLAGS = flags.FLAGS
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
REPLICAS = (1, 2)
STEPS_PER_CALL = (1, 10)
FIT = "model.fit"
SEED = 0


def define_flags():
    """Defines the bench flags (only when run: gpupar.cli also has --data_dir and --batch_size)."""
    flags.DEFINE_string("data_dir", None, f"Folder with the Fashion-MNIST IDX files; default {DEFAULT_DATA_DIR}.")
    flags.DEFINE_string("json", "runs/bench.json", "Write the results to this JSON file.")
    flags.DEFINE_integer("steps", 30, "Timed train steps per configuration and repeat.", lower_bound=1)
    flags.DEFINE_integer("repeats", 5, "Timed rounds over all configurations.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 1024, "Examples per replica per step.", lower_bound=1)


def gpupar_name(steps_per_call):
    """The row name of gpupar's loop with this many steps per call."""
    return f"gpupar K={steps_per_call}"


class _Rounds(keras.callbacks.Callback):
    """Times every model.fit epoch after the first (warm-up) one, running `between()` before each."""

    def __init__(self, between):
        super().__init__()
        self.between = between
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        if epoch > 0:
            self.between()
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        if epoch > 0:  # the epoch has synchronised: Keras waits for the device at its end
            self.seconds.append(time.perf_counter() - self.started)


def bench_strategy(num_replicas, splits, batch_size, steps, repeats):
    """Images/s per repeat of each configuration on one strategy: {name: [...]}, plus the plan."""
    plan = detected_plan("one_device" if num_replicas == 1 else "mirrored", max_cpus=num_replicas)
    print(plan.describe(), flush=True)
    strategy = build_strategy(plan)
    global_batch = batch_size * num_replicas
    dataset = data.train_dataset(splits.train_images, splits.train_labels, global_batch, SEED)

    keras.utils.set_random_seed(SEED)
    with strategy.scope():
        ours = build_convnet(dropout=0.5, seed=SEED)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(ours.trainable_variables)
        theirs = build_convnet(dropout=0.5, seed=SEED)
        theirs.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    train = make_train_function(strategy, ours, optimizer, global_batch)
    iterator = keep_for_process(iter(strategy.experimental_distribute_dataset(dataset)))

    def run_ours(steps_per_call, calls):
        for _ in range(calls):
            loss_sum, correct_sum, waited, busy = train(iterator, tf.constant(steps_per_call), tf.constant(False))
            float(loss_sum), float(correct_sum), float(waited), float(busy)  # as gpupar's epoch loop reads them

    results = {gpupar_name(k): [] for k in STEPS_PER_CALL}

    def one_round_of_ours():
        for k in STEPS_PER_CALL:
            calls = math.ceil(steps / k)
            started = time.perf_counter()
            run_ours(k, calls)
            results[gpupar_name(k)].append(calls * k * global_batch / (time.perf_counter() - started))

    for k in STEPS_PER_CALL:  # warm-up: tracing, then one untimed call of each size
        run_ours(k, 2 if k == 1 else 1)
    # One fit call, so Keras makes (and later destroys) its iterator once: epoch 0 is its
    # warm-up, and before each later epoch the callback runs one round of gpupar's loop.
    rounds = _Rounds(one_round_of_ours)
    theirs.fit(dataset, epochs=repeats + 1, steps_per_epoch=steps, callbacks=[rounds], shuffle=False, verbose=0)
    results[FIT] = [steps * global_batch / s for s in rounds.seconds]
    return results, plan


def summarise(images_per_second):
    """Median, min and max of a list of images/s."""
    return {
        "median": statistics.median(images_per_second),
        "min": min(images_per_second),
        "max": max(images_per_second),
    }


def table(report):
    """The results as text: one row per configuration, then the gpupar/model.fit ratios."""
    lines = [f"{'configuration':<14}{'replicas':>9}{'global batch':>14}{'steps':>7}"
             f"{'img/s median':>14}{'min':>9}{'max':>9}"]
    for row in report["configurations"]:
        lines.append(
            f"{row['name']:<14}{row['replicas']:>9}{row['global_batch']:>14}{row['steps']:>7}"
            f"{row['median']:>14,.0f}{row['min']:>9,.0f}{row['max']:>9,.0f}"
        )
    for replicas, ratios in report["ratios"].items():
        text = ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items())
        lines.append(f"gpupar/model.fit (median), {replicas} replica{'s' if int(replicas) > 1 else ''}: {text}")
    return "\n".join(lines)


def benchmark(data_dir, batch_size, steps, repeats):
    """Runs every configuration and returns the JSON-ready report."""
    splits = data.load_splits("fashion_mnist", data_dir)
    report = {
        "machine": {
            "nproc": len(os.sched_getaffinity(0)),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
        },
        "data_dir": data_dir,
        "batch_size": batch_size,
        "steps": steps,
        "repeats": repeats,
        "strategies": {},
        "configurations": [],
        "ratios": {},
    }
    for replicas in REPLICAS:
        results, plan = bench_strategy(replicas, splits, batch_size, steps, repeats)
        report["strategies"][str(replicas)] = plan.describe()
        for name, values in results.items():
            k = 1 if name == FIT else int(name.split("=")[1])
            report["configurations"].append({
                "name": name,
                "replicas": replicas,
                "global_batch": batch_size * replicas,
                "steps": steps if name == FIT else math.ceil(steps / k) * k,
                "images_per_second": values,
                **summarise(values),
            })
        fit_median = statistics.median(results[FIT])
        report["ratios"][str(replicas)] = {
            gpupar_name(k): statistics.median(results[gpupar_name(k)]) / fit_median for k in STEPS_PER_CALL
        }
    return report


def main(argv):
    """Checks the flags, configures 2 virtual CPUs, benchmarks, prints the table and writes JSON."""
    if len(argv) > 1:
        print(f"gpupar.bench: error: unexpected argument(s) {' '.join(argv[1:])}", file=sys.stderr)
        return 2
    if not FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)
    data_dir = FLAGS.data_dir or DEFAULT_DATA_DIR
    if not os.path.isdir(data_dir):
        where = f"--data_dir={data_dir} is not a folder" if FLAGS.data_dir else f"no Fashion-MNIST at {data_dir}"
        print(
            f"gpupar.bench: error: {where}; pass --data_dir=DIR, a folder with the four IDX files "
            "(Debian: apt-get install dataset-fashion-mnist)",
            file=sys.stderr,
        )
        return 2
    try:
        configure_devices(Config(virtual_cpus=max(REPLICAS)))
        started = time.perf_counter()
        report = benchmark(data_dir, FLAGS.batch_size, FLAGS.steps, FLAGS.repeats)
    except GpuparError as e:
        print(f"gpupar.bench: error: {e}", file=sys.stderr)
        return 1
    report["seconds"] = time.perf_counter() - started
    print(table(report))
    if FLAGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {FLAGS.json} ({report['seconds']:.0f} s)")
    return 0


def _main_and_exit(argv):
    exit_without_teardown(main(argv))


def run():
    """Defines the flags and runs the benchmark."""
    define_flags()
    app.run(_main_and_exit)


if __name__ == "__main__":
    run()
