"""Training images/s of strategy=model_parallel: 1 vs 4 micro-batches, on 1, 2 and 3 virtual devices.

    python -m benchmarks.pipeline                                   # about 5 minutes on 2 cores
    python benchmarks/pipeline.py --json=runs/bench_pipeline.json
    python -m benchmarks.pipeline --steps=2 --repeats=1 --batch_size=32 --lstm_units=16   # quick check

Models: the stacked LSTM with one layer per device (2 and 3 layers) and the ConvNet (2 stages).
Each model runs split over as many virtual CPUs as it has stages, and, as the baseline, with
every stage on /cpu:0 (the same pipeline code, no device crossings), each with M=1 and M=4
micro-batches. Every round times `steps` steps of each configuration in one call, after an
untimed warm-up, so machine noise hits them alike. "ideal" is GPipe's speed-up over M=1 on
devices that run in parallel, S*M / (M + S - 1); virtual CPUs share the machine's cores. The
ratios ("vs M=1", "vs 1 device") are medians of ratios taken within each round.
"""

import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __package__ in (None, ""):  # run as a file, python benchmarks/pipeline.py: the repository's root is the package's
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402  (the environment variable must come first)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from benchmarks import script  # noqa: E402
from gpupar import keras_compat  # noqa: E402
from gpupar.config import Config  # noqa: E402
from gpupar.data import array_pipeline as pipeline, mnist_images as mnist  # noqa: E402
from gpupar.errors import GpuparError  # noqa: E402
from gpupar.models import convnet, lstm  # noqa: E402
from gpupar.models.staged import build_on_stages, chain_layers  # noqa: E402
from gpupar.runtime.devices import configure_devices  # noqa: E402
from gpupar.runtime.stages import StagePlan, plan_stages, stage_of_layers  # noqa: E402
from gpupar.presets.mnist import LOSS, METRICS  # noqa: E402
from gpupar.training.steps.pipelined import PipelineStep  # noqa: E402
from gpupar.training.steps.step import train_function  # noqa: E402

FLAGS = flags.FLAGS
MICROBATCHES = (1, 4)
MAX_DEVICES = 3
SEED = 0
MODELS = ("lstm-2", "lstm-3", "convnet")


def define_flags():
    """Defines the flags (only when run as a script)."""
    flags.DEFINE_string("data_dir", None, f"Folder with the Fashion-MNIST IDX files; default {script.DEFAULT_DATA_DIR}.")
    flags.DEFINE_string("json", "runs/bench_pipeline.json", "Write the results to this JSON file.")
    flags.DEFINE_integer("steps", 8, "Timed train steps per configuration and round.", lower_bound=1)
    flags.DEFINE_integer("repeats", 3, "Timed rounds over all configurations.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 1024, "Examples per step (a multiple of 4).", lower_bound=4)
    flags.DEFINE_integer("lstm_units", 128, "Units in each LSTM layer.", lower_bound=1)
    flags.DEFINE_list("models", list(MODELS), f"Models to benchmark, some of: {', '.join(MODELS)}.")


def models(lstm_units):
    """(name, where its stages end, builder()) of each benchmarked model."""
    return [
        ("lstm-2", lstm.stage_ends(2), lambda: lstm.build_lstm(2, lstm_units, seed=SEED)),
        ("lstm-3", lstm.stage_ends(3), lambda: lstm.build_lstm(3, lstm_units, seed=SEED)),
        ("convnet", convnet.STAGE_ENDS, lambda: convnet.build_convnet(0.0, seed=SEED)),
    ]


def pipelined(build, ends, plan, microbatches, sample):
    """(the PipelineStep, its train function) of the model build() makes, split at `ends` over plan, with Adam.

    Its calls run inside step.in_call(), as the loop runs them.
    """
    keras.utils.set_random_seed(SEED)
    model = build_on_stages(build, ends, plan.variable_devices)
    stage_of = stage_of_layers([layer.name for layer in chain_layers(model)], ends)
    optimizer = keras.optimizers.Adam(1e-3)
    model.compile(optimizer=optimizer, loss=LOSS, metrics=METRICS)
    keras_compat.symbolic_build(model, sample)  # the compiled loss and metrics, as gpupar's set-up builds them
    optimizer.build(model.trainable_variables)
    step = PipelineStep(model, stage_of, plan, optimizer, microbatches)
    return step, train_function(step, None)


def ideal_speedup(stages: int, microbatches: int) -> float:
    """GPipe's speed-up of M micro-batches over 1 when every stage has its own processor."""
    return stages * microbatches / (microbatches + stages - 1)


def configurations(splits, batch_size, lstm_units, names=MODELS):
    """Every configuration of the named models, ready to time: row fields and a `run(steps)` closure."""
    devices = [f"/cpu:{i}" for i in range(MAX_DEVICES)]
    dataset = pipeline.train_dataset((splits.train_images, splits.train_labels), batch_size, SEED).map(mnist.normalise)
    rows = []
    for name, ends, build in [m for m in models(lstm_units) if m[0] in names]:
        stages = len(ends) + 1
        for placement, plan in (("1 device", StagePlan(((devices[0],) * stages,))),
                                (f"{stages} devices", plan_stages(devices[:stages], stages))):
            for microbatches in MICROBATCHES:
                step, train = pipelined(build, ends, plan, microbatches, _sample(splits))
                iterator = iter(dataset)

                def run(steps, step=step, train=train, iterator=iterator):
                    with step.in_call():  # as the loop calls it: the compiled loss over the whole batch
                        float(train(iterator, tf.constant(steps))[0][0])  # waits for the step to finish

                run(1)  # tracing
                rows.append({"model": name, "stages": stages, "placement": placement,
                             "devices": list(dict.fromkeys(plan.replicas[0])), "microbatches": microbatches,
                             "run": run, "images_per_second": []})
    return rows


def _sample(splits):
    """Two normalised training images and their labels, to build the model's compiled loss and metrics on."""
    return mnist.normalise(splits.train_images[:2], splits.train_labels[:2])


def _paired(row, baseline):
    """Median over rounds of row's images/s divided by baseline's in the same round."""
    return statistics.median(a / b for a, b in zip(row["images_per_second"], baseline["images_per_second"]))


class Busy(keras.layers.Layer):
    """The identity, after holding its thread for `seconds` x its share of the batch, without using a core.

    It stands in for a stage's compute in the schedule probe: the time a step takes then shows
    how much of the stages' work TensorFlow ran at the same time, whatever else the cores do.
    """

    def __init__(self, seconds, batch, **kwargs):
        super().__init__(**kwargs)
        self.seconds, self.batch = seconds, batch

    def call(self, x):
        def hold(values):
            time.sleep(self.seconds * len(values) / self.batch)
            return np.float32(0)

        # x itself is the input, so the wait runs in the step, after x is ready; stateless, so
        # the waits of different micro-batches are not put in program order.
        return x + tf.ensure_shape(tf.numpy_function(hold, [x], tf.float32, stateful=False), [])

    def compute_output_shape(self, input_shape):
        return input_shape


def schedule_probe(splits, batch_size, seconds=0.2, repeats=3):
    """Step time of a 3-stage pipeline whose stages only wait `seconds` per batch in the forward pass.

    Run one after another, the three waits take 3 x seconds whatever M is; with M micro-batches
    overlapped as GPipe does (each stage on one micro-batch at a time), (M + 2) / M x seconds; no
    schedule beats the critical path, one micro-batch through the three stages: 3 / M x seconds.
    """
    devices = [f"/cpu:{i}" for i in range(MAX_DEVICES)]
    dataset = pipeline.train_dataset((splits.train_images, splits.train_labels), batch_size, SEED).map(mnist.normalise)
    rows = []
    def build():
        layers = [keras.Input((28, 28, 1))]
        for _ in range(3):  # a stage each; Dense(2) is little compute beside the wait
            layers += [keras.layers.Flatten(), keras.layers.Dense(2), Busy(seconds, batch_size)]
        return keras.Sequential([*layers, keras.layers.Dense(10)], name="probe")

    for placement, plan in (("1 device", StagePlan(((devices[0],) * 3,))), ("3 devices", plan_stages(devices, 3))):
        for microbatches in MICROBATCHES:
            step, train = pipelined(build, (2, 5), plan, microbatches, _sample(splits))
            iterator = iter(dataset)
            with step.in_call():
                float(train(iterator, tf.constant(1))[0][0])  # tracing
                times = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    float(train(iterator, tf.constant(1))[0][0])
                    times.append(time.perf_counter() - started)
            rows.append({"placement": placement, "microbatches": microbatches, "stage_seconds": seconds,
                         "step_seconds": statistics.median(times), "one_after_another": 3 * seconds,
                         "gpipe_overlap": (microbatches + 2) / microbatches * seconds,
                         "critical_path": 3 * seconds / microbatches})
    return rows


def benchmark(data_dir, batch_size, steps, repeats, lstm_units, names=MODELS, probe_seconds=0.2):
    """Times every configuration in interleaved rounds; returns the JSON-ready report."""
    splits = mnist.load_splits("fashion_mnist", data_dir)
    rows = configurations(splits, batch_size, lstm_units, names)
    for _ in range(repeats):
        for row in rows:
            row["run"](1)  # untimed: the iterator and caches are warm
            started = time.perf_counter()
            row["run"](steps)
            row["images_per_second"].append(steps * batch_size / (time.perf_counter() - started))
    probe = schedule_probe(splits, batch_size, probe_seconds, repeats)
    by_key = {(r["model"], r["placement"], r["microbatches"]): r for r in rows}
    for row in rows:
        del row["run"]
        row.update(median=statistics.median(row["images_per_second"]), min=min(row["images_per_second"]),
                   max=max(row["images_per_second"]))
        # Ratios within each round, where the machine's load was the same, then their median.
        row["speedup_over_m1"] = _paired(row, by_key[row["model"], row["placement"], 1])
        row["ideal_speedup_over_m1"] = ideal_speedup(len(row["devices"]), row["microbatches"])
        row["vs_one_device"] = _paired(row, by_key[row["model"], "1 device", row["microbatches"]])
    return {
        "machine": {"nproc": len(os.sched_getaffinity(0)), "platform": platform.platform(),
                    "python": platform.python_version(), "tensorflow": tf.__version__, "keras": keras.__version__},
        "data_dir": data_dir, "batch_size": batch_size, "steps": steps, "repeats": repeats,
        "lstm_units": lstm_units, "configurations": rows, "schedule_probe": probe,
    }


def table(report):
    """The results as markdown, one row per configuration, then the schedule probe's."""
    lines = ["| model | placement | M | img/s median | min | max | vs M=1 | ideal | vs 1 device |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["configurations"]:
        lines.append(f"| {r['model']} | {r['placement']} | {r['microbatches']} | {r['median']:,.0f} | {r['min']:,.0f} "
                     f"| {r['max']:,.0f} | {r['speedup_over_m1']:.2f}x | {r['ideal_speedup_over_m1']:.2f}x "
                     f"| {r['vs_one_device']:.2f}x |")
    lines += ["", "Schedule probe: 3 stages that each wait (not compute) for the seconds below per batch.", "",
              "| placement | M | step s | one after another | GPipe overlap | critical path |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in report["schedule_probe"]:
        lines.append(f"| {r['placement']} | {r['microbatches']} | {r['step_seconds']:.3f} | {r['one_after_another']:.3f} "
                     f"| {r['gpipe_overlap']:.3f} | {r['critical_path']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    """Checks the flags, configures 3 virtual CPUs, benchmarks, prints the table and writes JSON."""
    if not FLAGS["verbosity"].present:  # each configuration traces its own function: no retracing warnings
        absl_logging.set_verbosity(absl_logging.ERROR)
    data_dir = script.data_dir(FLAGS.data_dir)
    unknown = sorted(set(FLAGS.models) - set(MODELS))
    if unknown:
        raise script.UsageError(f"--models: {', '.join(unknown)} unknown; choose from {', '.join(MODELS)}")
    if FLAGS.batch_size % max(MICROBATCHES):
        raise script.UsageError(f"--batch_size={FLAGS.batch_size} must be a multiple of {max(MICROBATCHES)}")
    try:
        configure_devices(Config(virtual_cpus=MAX_DEVICES))
        started = time.perf_counter()
        report = benchmark(data_dir, FLAGS.batch_size, FLAGS.steps, FLAGS.repeats, FLAGS.lstm_units, FLAGS.models)
    except GpuparError as e:
        print(f"benchmarks.pipeline: error: {e}", file=sys.stderr)
        return 1
    report["seconds"] = time.perf_counter() - started
    print(table(report))
    if FLAGS.json:
        script.write_json(FLAGS.json, report)
    print(f"({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    script.run("benchmarks.pipeline", define_flags, main)
