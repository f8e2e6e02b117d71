"""gpupar.fit against Keras' model.fit on three keras-io examples, at 1 and 2 replicas: accuracy and speed.

    python -m benchmarks.keras_io                                  # about 8 minutes on 2 cores
    python -m benchmarks.keras_io --quick --json=/tmp/kio.json     # the tests' data, 2 epochs, 1 round
    python benchmarks/keras_io.py --examples=mnist_convnet --scale=8 --epochs=3 --repeats=1

The examples are the ports in tests/keras_io/ (mnist_convnet, bidirectional_lstm_imdb,
text_classification_with_transformer): each module's model_fn() and train(fit, workdir, scale,
epochs), whose synthetic data are `scale` times the tests' size. Every (example, runner,
replicas) combination trains in a fresh process (virtual CPUs and thread pools are fixed once
TensorFlow starts), one after another, interleaved over `--repeats` rounds so that machine noise
hits them alike; each round seeds both runners with the round's number (keras.utils.set_random_seed
before train(); gpupar.fit's seed=, which it gives set_random_seed itself).

- model.fit: the example's model built and compiled by model_fn(), with no strategy at 1
  replica and inside MirroredStrategy(["/cpu:0", "/cpu:1"])'s scope at 2, whose two virtual CPUs
  gpupar.configure_devices(virtual_cpus=2) makes (so both runners have the same devices and
  thread pools; --keras_threads=tensorflow makes them with tf.config alone, TensorFlow's pools).
- gpupar.fit: gpupar.fit(model_fn, ...) with strategy="one_device" at 1 replica, and
  strategy="mirrored", virtual_cpus=2 at 2 (after gpupar.configure_devices(virtual_cpus=2)).

Both get the example's own fit keywords (the same data, epochs and global batch), with verbose=0.
Measured: the validation accuracy after the last epoch (the history's val_*accuracy), and
training examples/s over the epochs after the first (the first includes tracing): for model.fit a
callback's clock from on_epoch_begin to on_epoch_end less the validation in between
(on_test_begin to on_test_end), over the training set's size; for gpupar.fit its records'
examples_per_second and seconds (training alone). The table gives medians over the rounds; the
difference and the ratio are medians of the per-round differences and ratios.
"""

import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __package__ in (None, ""):  # run as a file: the repository's root is the package's
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from benchmarks import script  # noqa: E402

FLAGS = flags.FLAGS

EXAMPLES = ("mnist_convnet", "bidirectional_lstm_imdb", "text_classification_with_transformer")
RUNNERS = ("fit", "gpupar")  # Keras' model.fit, gpupar.fit
NAMES = {"fit": "model.fit", "gpupar": "gpupar.fit"}
REPLICAS = (1, 2)
QUICK = {"scale": 1, "epochs": 2, "repeats": 1}
RESULT = "KERAS_IO "  # the worker's result line


def define_flags():
    """The benchmark's flags, and the worker's."""
    flags.DEFINE_list("examples", list(EXAMPLES), f"Which of {', '.join(EXAMPLES)} to run.")
    flags.DEFINE_integer("scale", 32, "Synthetic data: this many times the tests' size (train(scale=...)).",
                         lower_bound=1)
    flags.DEFINE_integer("epochs", 4, "Epochs of every fit (at least 2: the first is not timed).", lower_bound=2)
    flags.DEFINE_integer("repeats", 2, "Rounds: every combination trains once per round.", lower_bound=1)
    flags.DEFINE_bool("quick", False, "The tests' data (scale 1), 2 epochs, 1 round: a minute or two.")
    flags.DEFINE_enum("keras_threads", "gpupar", ["gpupar", "tensorflow"],
                      "model.fit at 2 replicas: virtual CPUs from gpupar.configure_devices (gpupar's thread pools, "
                      "as gpupar.fit has) or from tf.config alone (TensorFlow's default pools).")
    flags.DEFINE_string("json", "runs/keras_io.json", "Write the results here; empty for none.")
    flags.DEFINE_string("worker", None, "Internal: run one combination, EXAMPLE,RUNNER,REPLICAS,SEED, and print "
                        "its result.")


# ---------------------------------------------------------------------------------------------
# The worker: one (example, runner, replicas) fit in this process.


def val_accuracy_name(history: dict) -> str:
    """The history's validation accuracy: the name that starts with val_ and ends with accuracy."""
    names = sorted(n for n in history if n.startswith("val_") and n.endswith("accuracy"))
    if not names:
        raise SystemExit(f"benchmarks.keras_io: no val_*accuracy in the history ({', '.join(history)})")
    return names[0]


def training_size(x, validation_split) -> int:
    """Examples model.fit trains on per epoch: x's, less what validation_split holds out (as Keras splits)."""
    n = len(x)
    return int(math.floor(n * (1.0 - validation_split))) if validation_split else n


def validation_size(x, kwargs) -> int:
    """Examples the fit validates on: validation_data's, or what validation_split holds out of x."""
    if kwargs.get("validation_data") is not None:
        return len(kwargs["validation_data"][0])
    return len(x) - training_size(x, kwargs.get("validation_split", 0.0))


def rate(examples, seconds) -> float:
    """Examples per second over the epochs after the first: total examples over total seconds."""
    return sum(examples[1:]) / sum(seconds[1:])


def keras_fit(example, replicas):
    """A fit with model.fit's signature: builds the example's model (in MirroredStrategy's scope at 2
    replicas) and trains it with Keras' model.fit, timing every epoch's training; returns (history, examples
    per epoch, seconds per epoch, validation examples)."""
    import keras
    import tensorflow as tf

    class EpochTimer(keras.callbacks.Callback):
        """Seconds of each epoch's training: on_epoch_begin to on_epoch_end, less the validation between."""

        def __init__(self):
            super().__init__()
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self.began, self.validating = time.perf_counter(), 0.0

        def on_test_begin(self, logs=None):
            self.test_began = time.perf_counter()

        def on_test_end(self, logs=None):
            self.validating += time.perf_counter() - self.test_began

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.began - self.validating)

    timer = EpochTimer()

    def fit(x=None, y=None, **kwargs):
        if replicas > 1:
            strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
            with strategy.scope():
                model = example.model_fn()
        else:
            model = example.model_fn()
        kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [timer]
        kwargs["verbose"] = 0
        history = model.fit(x, y, **kwargs)
        size = training_size(x, kwargs.get("validation_split", 0.0))
        return history.history, [size] * len(timer.seconds), timer.seconds, validation_size(x, kwargs)

    return fit


def gpupar_fit(example, replicas, seed):
    """A fit with model.fit's signature: gpupar.fit(model_fn, ...) on one device or mirrored over the virtual CPUs;
    returns (history, examples per epoch, seconds per epoch, validation examples). gpupar seeds Keras itself
    (keras.utils.set_random_seed(Config.seed), 0 by default), so the round's seed goes in as seed=."""
    import gpupar

    options = dict(strategy="mirrored", virtual_cpus=replicas) if replicas > 1 else dict(strategy="one_device")

    def fit(x=None, y=None, **kwargs):
        kwargs["verbose"] = 0
        result = gpupar.fit(example.model_fn, x, y, save=False, seed=seed, **options, **kwargs)
        if result.replicas != replicas:
            raise SystemExit(f"benchmarks.keras_io: asked for {replicas} replicas, got {result.strategy_description}")
        return (result.history, [r.examples_per_second * r.seconds for r in result.records],
                [r.seconds for r in result.records], validation_size(x, kwargs))

    return fit


def work(example_name: str, runner: str, replicas: int, seed: int, scale: int, epochs: int, keras_threads: str):
    """Trains one combination in this fresh process and prints its RESULT line."""
    started = time.perf_counter()
    if replicas > 1:  # before anything starts TensorFlow
        if runner == "gpupar" or keras_threads == "gpupar":
            import gpupar

            gpupar.configure_devices(virtual_cpus=replicas)
        else:
            import tensorflow as tf

            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    import keras

    sys.path.insert(0, os.path.join(script.ROOT, "tests"))  # the ports are the tests' package keras_io
    example = importlib.import_module(f"keras_io.{example_name}")
    fit = keras_fit(example, replicas) if runner == "fit" else gpupar_fit(example, replicas, seed)
    keras.utils.set_random_seed(seed)
    with tempfile.TemporaryDirectory(prefix="keras_io_bench_") as workdir:
        history, examples, seconds, validated = example.train(fit, workdir, scale=scale, epochs=epochs)
    name = val_accuracy_name(history)
    print(RESULT + json.dumps({
        "val_accuracy": float(history[name][-1]), "metric": name,
        "val_accuracy_per_epoch": [float(a) for a in history[name]],
        "examples_per_second": rate(examples, seconds),
        "epoch_examples_per_second": [e / s for e, s in zip(examples, seconds)],
        "epoch_seconds": seconds, "train_examples": round(examples[-1]), "val_examples": validated,
        "process_seconds": time.perf_counter() - started,
    }), flush=True)


# ---------------------------------------------------------------------------------------------
# The driver: every combination in a process of its own, round after round.


def run_one(example, runner, replicas, seed, scale, epochs, keras_threads) -> dict:
    """Starts a worker process for one combination and returns its result."""
    command = [sys.executable, "-m", "benchmarks.keras_io", f"--worker={example},{runner},{replicas},{seed}",
               f"--scale={scale}", f"--epochs={epochs}", f"--keras_threads={keras_threads}", "--json="]
    done = subprocess.run(command, capture_output=True, text=True, cwd=script.ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise RuntimeError(f"benchmarks.keras_io: {example} {NAMES[runner]} x{replicas} failed "
                           f"(status {done.returncode})")
    return json.loads(lines[-1][len(RESULT):])


def measure(examples, scale, epochs, repeats, keras_threads) -> dict:
    """Every combination once per round, interleaved; the report with per-round results and medians."""
    runs = {(e, r, n): [] for e in examples for r in REPLICAS for n in RUNNERS}
    started = time.perf_counter()
    for round_ in range(repeats):
        order = RUNNERS if round_ % 2 == 0 else RUNNERS[::-1]  # neither runner always goes first
        for example in examples:
            for replicas in REPLICAS:
                for runner in order:
                    result = run_one(example, runner, replicas, round_, scale, epochs, keras_threads)
                    runs[(example, replicas, runner)].append(result)
                    print(f"round {round_ + 1}/{repeats}  {example} x{replicas}  {NAMES[runner]}: "
                          f"{result['metric']} {result['val_accuracy']:.4f}, "
                          f"{result['examples_per_second']:,.0f} examples/s, "
                          f"{result['process_seconds']:.0f} s", flush=True)
    rows = []
    for example in examples:
        for replicas in REPLICAS:
            fit, ours = runs[(example, replicas, "fit")], runs[(example, replicas, "gpupar")]
            rows.append({
                "example": example, "replicas": replicas, "metric": fit[0]["metric"],
                "fit_val_accuracy": statistics.median(r["val_accuracy"] for r in fit),
                "gpupar_val_accuracy": statistics.median(r["val_accuracy"] for r in ours),
                "difference": statistics.median(o["val_accuracy"] - f["val_accuracy"] for f, o in zip(fit, ours)),
                "fit_examples_per_second": statistics.median(r["examples_per_second"] for r in fit),
                "gpupar_examples_per_second": statistics.median(r["examples_per_second"] for r in ours),
                "ratio": statistics.median(o["examples_per_second"] / f["examples_per_second"]
                                           for f, o in zip(fit, ours)),
                "train_examples": fit[0]["train_examples"], "val_examples": fit[0]["val_examples"],
                "rounds": [{"model.fit": f, "gpupar.fit": o} for f, o in zip(fit, ours)],
            })
    return {"scale": scale, "epochs": epochs, "repeats": repeats, "keras_threads": keras_threads,
            "seconds": time.perf_counter() - started, "rows": rows}


def table(report) -> str:
    """The report as text: a row per example and replicas."""
    head = (f"{'example':<38}{'replicas':>9}{'fit val acc':>13}{'gpupar val acc':>16}{'diff':>9}"
            f"{'fit ex/s':>10}{'gpupar ex/s':>13}{'gpupar/fit':>12}")
    lines = [head]
    for row in report["rows"]:
        lines.append(f"{row['example']:<38}{row['replicas']:>9}{row['fit_val_accuracy']:>13.4f}"
                     f"{row['gpupar_val_accuracy']:>16.4f}{row['difference']:>+9.4f}"
                     f"{row['fit_examples_per_second']:>10,.0f}{row['gpupar_examples_per_second']:>13,.0f}"
                     f"{row['ratio']:>11.2f}x")
    lines.append(f"medians over {report['repeats']} round(s); data scale {report['scale']}, {report['epochs']} epochs, "
                 f"examples/s over epochs 2-{report['epochs']}; diff = gpupar - model.fit; "
                 f"{report['seconds']:.0f} s in all")
    if report["quick"]:
        sizes = ", ".join(sorted({str(r["val_examples"]) for r in report["rows"]}, key=int))
        lines.append(f"--quick: the tests' tiny data ({sizes} validation examples) and 2 epochs: a smoke test, "
                     "its accuracies are no comparison")
    for row in report["rows"]:
        if abs(row["difference"]) > 0.015:
            lines.append(f"note: {row['example']} x{row['replicas']}: validation accuracies differ by "
                         f"{row['difference']:+.4f} (per round: " + ", ".join(
                             f"{r['model.fit']['val_accuracy']:.4f} vs {r['gpupar.fit']['val_accuracy']:.4f}"
                             for r in row["rounds"]) + ")")
    return "\n".join(lines)


def main() -> int:
    """The driver (or, with --worker, one combination)."""
    if FLAGS.worker:
        example, runner, replicas, seed = FLAGS.worker.split(",")
        work(example, runner, int(replicas), int(seed), FLAGS.scale, FLAGS.epochs, FLAGS.keras_threads)
        return 0
    unknown = sorted(set(FLAGS.examples) - set(EXAMPLES))
    if unknown:
        raise script.UsageError(f"--examples: unknown {', '.join(unknown)}; choose from {', '.join(EXAMPLES)}")
    settings = dict(QUICK) if FLAGS.quick else {"scale": FLAGS.scale, "epochs": FLAGS.epochs,
                                                "repeats": FLAGS.repeats}
    report = {"quick": FLAGS.quick, **measure(FLAGS.examples, keras_threads=FLAGS.keras_threads, **settings)}
    print(table(report))
    if FLAGS.json:
        script.write_json(FLAGS.json, report)
    return 0


if __name__ == "__main__":
    script.run("benchmarks.keras_io", define_flags, main)
