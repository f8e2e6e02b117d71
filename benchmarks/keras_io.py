"""gpupar.fit against Keras' model.fit, at its defaults and at its best, on five keras-io programs, at 1 and 2
replicas, in float32 and bfloat16; and how close each runs to this machine's limit.

    python -m benchmarks.keras_io                                  # about 30 minutes on an idle 2-core machine
    python -m benchmarks.keras_io --quick --json=/tmp/kio.json     # the tests' data, 2 epochs, 1 round
    python benchmarks/keras_io.py --examples=mnist_convnet --scale=8 --epochs=3 --repeats=1 --precisions=float32

The programs are the ports in tests/keras_io/, one of each kind: mnist_convnet (convolutional),
bidirectional_lstm_imdb (recurrent), text_classification_with_transformer (transformer),
dcgan_overriding_train_step (a GAN with its own train_step, fed a tf.data.Dataset) and
oxford_pets_image_segmentation (a U-Net fed by a keras.utils.PyDataset). Each module has model_fn()
and train(fit, workdir, scale, epochs), whose synthetic data are `scale` times the tests' size
(SCALES: each program's default, chosen so that an epoch takes a few seconds here). Every
(example, replicas, precision, runner) combination trains in a fresh process (virtual CPUs,
thread pools and the dtype policy are fixed once TensorFlow starts), one after another,
interleaved over `--repeats` rounds so that machine noise hits them alike; each round seeds both
runners with the round's number (keras.utils.set_random_seed before train(); gpupar.fit's seed=,
which it gives set_random_seed itself).

- model.fit: the example's model built and compiled by model_fn(), with no strategy at 1
  replica and inside MirroredStrategy(["/cpu:0", "/cpu:1"])'s scope at 2, whose two virtual CPUs
  gpupar.configure_devices(virtual_cpus=2) makes (so both runners have the same devices and
  thread pools; --keras_threads=tensorflow makes them with tf.config alone, TensorFlow's pools).
  In bfloat16, keras.config.set_dtype_policy("mixed_bfloat16") before model_fn(). The GAN at 2
  replicas gets the workaround model.fit needs under MirroredStrategy (mirrored_fit_ready).
- model.fit at its best ("tuned", float32 alone): the same, with as many steps per tf.function
  call as gpupar.fit runs by default (steps_per_execution=10, STEPS_PER_CALL), set on the model
  that model_fn() compiled, as compile(steps_per_execution=10) sets it. Where it fails (Keras
  3.15 under MirroredStrategy, on each of these programs), its row says the error, and the best
  model.fit that runs is its default.
- gpupar.fit: gpupar.fit(model_fn, ...) with strategy="one_device" at 1 replica, and
  strategy="mirrored", virtual_cpus=2 at 2 (after gpupar.configure_devices(virtual_cpus=2));
  precision="mixed_bfloat16" in bfloat16 (gpupar sets that policy around model_fn).

Both get the example's own fit keywords (the same data, epochs and global batch), with verbose=0.
Measured: the program's quality after the last epoch, and training examples/s over the epochs
after the first (the first includes tracing). Quality: the validation accuracy (val_*accuracy)
where the program has one; the validation loss for the segmentation model (compiled with a loss
alone); the GAN's last logged d_loss and g_loss (no validation, no accuracy). Examples/s: for
model.fit a callback's clock (first in the list, so that the program's own callbacks' epoch-end
work is outside it) from on_epoch_begin to on_epoch_end less the validation in between
(on_test_begin to on_test_end), over the examples of an epoch; for gpupar.fit its records'
examples_per_second and seconds (training alone). The tables give medians over the rounds; the
differences and ratios are medians of the per-round differences and ratios: gpupar.fit against
model.fit at the same replicas and precision, and bfloat16 against float32 for each runner.

The limit: a run's examples/s times the program's training FLOPs per example (matrix operations of
one train_step: benchmarks.roofline.step_flops_per_example, counted once per program in a process
of its own, `--worker=flops,EXAMPLE`) over this machine's float32 or bfloat16 matrix-multiply
rate (benchmarks.roofline.matmul_flops_per_second, measured in a fresh process at the start of
each round, `--worker=peak`): the fraction of the machine a program uses, so the headroom shows.

Time: 46 processes per round (5 programs x 2 replicas x 2 precisions x 2 runners, less the
transformer's 4 in bfloat16, which cannot run: CANNOT_RUN; 10 tuned runs in float32; the peak),
each 13-42 s on an idle 2-core machine (4-5 s of TensorFlow's start, 3-17 s of the first
epoch's tracing, 2 timed epochs of 1-8 s; the U-Net's tracing and the LSTM in bfloat16 are the
longest), and the 5 FLOP counts once.
"""

import importlib
import json
import math
import os
import re
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
from gpupar.config import STEPS_PER_CALL  # noqa: E402  (no TensorFlow: the driver stays light)

FLAGS = flags.FLAGS

KINDS = {  # each port, and the kind of program it stands for
    "mnist_convnet": "convolutional",
    "bidirectional_lstm_imdb": "recurrent",
    "text_classification_with_transformer": "transformer",
    "dcgan_overriding_train_step": "own train_step",
    "oxford_pets_image_segmentation": "PyDataset input",
}
EXAMPLES = tuple(KINDS)
# Each program's default data scale: an epoch of 1-5 s on 2 cores (training examples per epoch: 18,432 images,
# 2,048 and 4,096 reviews, 1,024 faces, 576 pet images; the LSTM takes about 2-3x longer in bfloat16).
SCALES = {"mnist_convnet": 32, "bidirectional_lstm_imdb": 8, "text_classification_with_transformer": 16,
          "dcgan_overriding_train_step": 8, "oxford_pets_image_segmentation": 8}
# Keras' model.fit at its defaults (one step per tf.function call), model.fit at its best (as many steps per call as
# gpupar.fit runs: compile's steps_per_execution), gpupar.fit.
RUNNERS = ("fit", "tuned", "gpupar")
TUNED_STEPS = STEPS_PER_CALL
NAMES = {"fit": "model.fit", "tuned": f"model.fit, steps_per_execution={TUNED_STEPS}", "gpupar": "gpupar.fit"}
TUNED_PRECISIONS = ("float32",)  # model.fit at its best in float32 alone: its bfloat16 runs would add 8 minutes
REPLICAS = (1, 2)
PRECISIONS = ("float32", "mixed_bfloat16")
# Combinations that fail under both runners, and why (the table says so in their rows).
CANNOT_RUN = {("text_classification_with_transformer", "mixed_bfloat16"):
              "text_classification_with_transformer in mixed_bfloat16, under model.fit and gpupar.fit alike: its "
              "Input(shape=(maxlen,)) is float32 and holds the token ids, which Keras' autocast rounds to bfloat16 in "
              "its first layer (id 999 becomes 1000, outside the Embedding's range: \"indices = 1000 is not in "
              "[0, 1000)\"); keras-io's program would need Input(shape=(maxlen,), dtype=\"int32\")."}
QUICK = {"scale": 1, "epochs": 2, "repeats": 1}
RESULT = "KERAS_IO "  # the worker's result line


def define_flags():
    """The benchmark's flags, and the worker's."""
    flags.DEFINE_list("examples", list(EXAMPLES), f"Which of {', '.join(EXAMPLES)} to run.")
    flags.DEFINE_integer("scale", None, "Synthetic data: this many times the tests' size (train(scale=...)) for every "
                         "program; empty: each program's own (" + ", ".join(f"{e} {s}" for e, s in SCALES.items()) + ").",
                         lower_bound=1)
    flags.DEFINE_integer("epochs", 3, "Epochs of every fit (at least 2: the first is not timed).", lower_bound=2)
    flags.DEFINE_integer("repeats", 2, "Rounds: every combination trains once per round.", lower_bound=1)
    flags.DEFINE_list("replicas", [str(r) for r in REPLICAS], "Replica counts, of 1 and 2.")
    flags.DEFINE_list("precisions", list(PRECISIONS), f"Number formats of both runners, of {', '.join(PRECISIONS)}.")
    flags.DEFINE_bool("quick", False, "The tests' data (scale 1), 2 epochs, 1 round: a smoke test.")
    flags.DEFINE_enum("keras_threads", "gpupar", ["gpupar", "tensorflow"],
                      "model.fit at 2 replicas: virtual CPUs from gpupar.configure_devices (gpupar's thread pools, "
                      "as gpupar.fit has) or from tf.config alone (TensorFlow's default pools).")
    flags.DEFINE_string("json", "runs/keras_io.json", "Write the results here; empty for none.")
    flags.DEFINE_string("worker", None, "Internal: run one combination, EXAMPLE,RUNNER,REPLICAS,PRECISION,SEED; or "
                        "flops,EXAMPLE (count its training FLOPs); or peak (this machine's matrix rates); and print "
                        "its result.")


# ---------------------------------------------------------------------------------------------
# The worker: one (example, runner, replicas, precision) fit in this process.


def quality_names(history: dict) -> list:
    """What the program's quality is read from: its val_*accuracy; else val_loss; else its logged losses (a GAN's)."""
    accuracies = sorted(n for n in history if n.startswith("val_") and n.endswith("accuracy"))
    if accuracies:
        return accuracies[:1]
    if "val_loss" in history:
        return ["val_loss"]
    losses = sorted(n for n in history if n.endswith("loss"))
    if losses:
        return losses
    raise SystemExit(f"benchmarks.keras_io: no accuracy or loss in the history ({', '.join(history)})")


def training_size(x, validation_split) -> int:
    """Examples model.fit trains on per epoch: x's, less what validation_split holds out (as Keras splits)."""
    n = count_examples(x)
    return int(math.floor(n * (1.0 - validation_split))) if validation_split else n


def count_examples(data) -> int:
    """Examples in arrays, a batched tf.data.Dataset or a PyDataset (its batches counted, after the fit)."""
    import keras
    import tensorflow as tf

    if isinstance(data, (tf.data.Dataset, keras.utils.PyDataset)):
        batches = data if isinstance(data, tf.data.Dataset) else (data[i] for i in range(len(data)))
        return sum(int(tf.nest.flatten(batch)[0].shape[0]) for batch in batches)
    return len(data)


def validation_size(x, kwargs) -> int:
    """Examples the fit validates on: validation_data's, or what validation_split holds out of x."""
    data = kwargs.get("validation_data")
    if data is not None:
        return count_examples(data[0] if isinstance(data, tuple) else data)
    return count_examples(x) - training_size(x, kwargs.get("validation_split", 0.0))


def rate(examples, seconds) -> float:
    """Examples per second over the epochs after the first: total examples over total seconds."""
    return sum(examples[1:]) / sum(seconds[1:])


def mirrored_fit_ready(gan):
    """keras-io's GAN as model.fit can train it under MirroredStrategy (called in the strategy's scope): the class
    has no call(), which fit would call to build it, and its optimizers would build their slots lazily inside the
    replicated step ("You must feed a value for placeholder tensor")."""
    gan.built = True
    gan.d_optimizer.build(gan.discriminator.trainable_variables)
    gan.g_optimizer.build(gan.generator.trainable_variables)
    return gan


MIRRORED_FIT_READY = {"dcgan_overriding_train_step": mirrored_fit_ready}  # model.fit's workaround at 2 replicas


def keras_fit(example, replicas, precision="float32", ready=None, steps_per_execution=1, callbacks=()):
    """A fit with model.fit's signature: builds the example's model (in MirroredStrategy's scope at 2 replicas, in
    the precision's dtype policy) and trains it with Keras' model.fit, `steps_per_execution` steps per tf.function
    call (compile's), timing every epoch's training; returns (history, examples per epoch, seconds per epoch,
    validation examples). `ready(model)`, if given, runs on the model at 2 replicas, in the strategy's scope;
    `callbacks` go after the program's own."""
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
        keras.config.set_dtype_policy(precision)
        if replicas > 1:
            strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
            with strategy.scope():
                model = example.model_fn()
                if ready is not None:
                    model = ready(model)
        else:
            model = example.model_fn()
        model.steps_per_execution = steps_per_execution  # as compile(steps_per_execution=...) sets it
        # The timer first: the others' epoch ends are not timed.
        kwargs["callbacks"] = [timer] + list(kwargs.get("callbacks") or []) + list(callbacks)
        kwargs["verbose"] = 0
        history = model.fit(x, y, **kwargs)
        size = training_size(x, kwargs.get("validation_split", 0.0))
        return history.history, [size] * len(timer.seconds), timer.seconds, validation_size(x, kwargs)

    return fit


def gpupar_fit(example, replicas, seed, precision="float32", callbacks=()):
    """A fit with model.fit's signature: gpupar.fit(model_fn, ...) on one device or mirrored over the virtual CPUs;
    returns (history, examples per epoch, seconds per epoch, validation examples). gpupar seeds Keras itself
    (keras.utils.set_random_seed(Config.seed), 0 by default), so the round's seed goes in as seed=. `callbacks` go
    after the program's own."""
    import gpupar

    options = dict(strategy="mirrored", virtual_cpus=replicas) if replicas > 1 else dict(strategy="one_device")

    def fit(x=None, y=None, **kwargs):
        kwargs["verbose"] = 0
        kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + list(callbacks)
        result = gpupar.fit(example.model_fn, x, y, save=False, seed=seed, precision=precision, **options, **kwargs)
        if result.replicas != replicas:
            raise SystemExit(f"benchmarks.keras_io: asked for {replicas} replicas, got {result.strategy_description}")
        return (result.history, [r.examples_per_second * r.seconds for r in result.records],
                [r.seconds for r in result.records], validation_size(x, kwargs))

    return fit


def _port(example_name: str):
    """The port of a keras-io program: a module of tests/keras_io."""
    sys.path.insert(0, os.path.join(script.ROOT, "tests"))  # the ports are the tests' package keras_io
    return importlib.import_module(f"keras_io.{example_name}")


def first_batch(x, y, batch_size):
    """The first batch model.fit trains on: a dataset's or a PyDataset's first, else (x, y) arrays' first rows."""
    import keras
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        return next(iter(x))
    if isinstance(x, keras.utils.PyDataset):
        return x[0]
    return tf.nest.map_structure(lambda a: a[:batch_size or 32], x if y is None else (x, y))


def count_flops(example_name: str):
    """Prints the RESULT line of the program's training FLOPs per example (benchmarks.roofline), counted on its model
    (float32, one device) after one step of model.fit on the tests' data: the count's precondition, a built model
    and optimizer."""
    from benchmarks.roofline import step_flops_per_example

    example, counted = _port(example_name), {}

    def fit(x=None, y=None, **kwargs):
        model = example.model_fn()
        kwargs.update(epochs=1, steps_per_epoch=1, verbose=0, callbacks=[])
        history = model.fit(x, y, **kwargs)
        counted["flops_per_example"] = step_flops_per_example(model, first_batch(x, y, kwargs.get("batch_size")))
        return history.history, [1], [1.0], 0

    with tempfile.TemporaryDirectory(prefix="keras_io_flops_") as workdir:
        example.train(fit, workdir, scale=1, epochs=2)
    print(RESULT + json.dumps(counted), flush=True)


def measure_peak():
    """Prints the RESULT line of this machine's matrix-multiply rates, FLOP/s, in float32 and in bfloat16 (the
    rates of the two precisions the programs run in: mixed_bfloat16 multiplies in bfloat16)."""
    import tensorflow as tf

    from benchmarks.roofline import matmul_flops_per_second

    print(RESULT + json.dumps({"float32": matmul_flops_per_second(tf.float32),
                               "mixed_bfloat16": matmul_flops_per_second(tf.bfloat16)}), flush=True)


def work(example_name: str, runner: str, replicas: int, precision: str, seed: int, scale: int, epochs: int,
         keras_threads: str, callbacks=()):
    """Trains one combination in this fresh process and prints its RESULT line (model.fit at its best: its error,
    where it fails); `callbacks` (Keras callbacks) watch the fit too."""
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

    example = _port(example_name)
    if runner == "gpupar":
        fit = gpupar_fit(example, replicas, seed, precision, callbacks)
    else:
        fit = keras_fit(example, replicas, precision, MIRRORED_FIT_READY.get(example_name),
                        TUNED_STEPS if runner == "tuned" else 1, callbacks)
    keras.utils.set_random_seed(seed)
    with tempfile.TemporaryDirectory(prefix="keras_io_bench_") as workdir:
        try:
            history, examples, seconds, validated = example.train(fit, workdir, scale=scale, epochs=epochs)
        except Exception as e:  # noqa: BLE001  (model.fit at its best may fail: the table says how)
            if runner != "tuned":
                raise
            print(RESULT + json.dumps({"failed": failure(e)}), flush=True)
            return
    names = quality_names(history)
    print(RESULT + json.dumps({
        "quality": {name: float(history[name][-1]) for name in names},
        "quality_per_epoch": {name: [float(v) for v in history[name]] for name in names},
        "examples_per_second": rate(examples, seconds),
        "epoch_examples_per_second": [e / s for e, s in zip(examples, seconds)],
        "epoch_seconds": seconds, "train_examples": round(examples[-1]), "val_examples": validated,
        "process_seconds": time.perf_counter() - started,
    }), flush=True)


def failure(error: BaseException) -> str:
    """An error in one line: its type and its message's first line, or for TensorFlow's "Graph execution error"
    (whose next lines are the call stack of the node) its first root error's."""
    text = str(error).strip()
    root = re.search(r"(?m)^\s*(?:\(\d+\) )?[A-Z_]+:\s+(.+)$", text)
    message = root[1] if root else (text.splitlines() or [""])[0]
    return f"{type(error).__name__}: {message.strip()[:300]}"


# ---------------------------------------------------------------------------------------------
# The driver: every combination in a process of its own, round after round.


def run_worker(task: str, *flags) -> dict:
    """Starts a worker process for one task (--worker=task) and returns its result."""
    command = [sys.executable, "-m", "benchmarks.keras_io", f"--worker={task}", *flags, "--json="]
    done = subprocess.run(command, capture_output=True, text=True, cwd=script.ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise RuntimeError(f"benchmarks.keras_io: worker {task} failed (status {done.returncode})")
    return json.loads(lines[-1][len(RESULT):])


def run_one(example, runner, replicas, precision, seed, scale, epochs, keras_threads) -> dict:
    """Starts a worker process for one combination and returns its result."""
    return run_worker(f"{example},{runner},{replicas},{precision},{seed}", f"--scale={scale}", f"--epochs={epochs}",
                      f"--keras_threads={keras_threads}")


def _said(result: dict) -> str:
    """One worker's result in a progress line: its quality and speed, or how it failed."""
    if "failed" in result:
        return f"failed: {result['failed']}"
    quality = ", ".join(f"{k} {v:.4f}" for k, v in result["quality"].items())
    return f"{quality}, {result['examples_per_second']:,.0f} examples/s, {result['process_seconds']:.0f} s"


def _best(fit, tuned) -> list:
    """model.fit at its best in each round: the faster of its runs at its defaults and tuned, where the tuned ran."""
    if not tuned or any("failed" in r for r in tuned):
        return fit
    return [max(f, t, key=lambda r: r["examples_per_second"]) for f, t in zip(fit, tuned)]


def _limits(runs: dict, flops_per_example, peak) -> dict:
    """How close each runner ran to this machine's limit: its median examples/s times the program's training FLOPs
    per example, over the matrix-multiply rate of the precision it ran in."""
    return {f"{name}_limit": statistics.median(r["examples_per_second"] for r in results) * flops_per_example / peak
            for name, results in runs.items()}


def _tuned(tuned, best, ours) -> dict:
    """model.fit at its best against gpupar.fit (float32 alone, TUNED_PRECISIONS): the tuned run's error where it
    fails (then the best that runs is model.fit's default, one step per call), else its medians; gpupar.fit's
    ratio to the best."""
    if not tuned:
        return {}
    failed = [r["failed"] for r in tuned if "failed" in r]
    if failed:
        return {"tuned_failed": failed[0], "best_ratio": _paired_ratio(ours, best)}
    return {"tuned_quality": _medians(tuned), "tuned_difference": _paired(ours, tuned, lambda o, t: o - t),
            "tuned_examples_per_second": statistics.median(r["examples_per_second"] for r in tuned),
            "tuned_ratio": _paired_ratio(ours, tuned), "best_ratio": _paired_ratio(ours, best)}


def _medians(results) -> dict:
    """The median of each quality over the rounds."""
    return {name: statistics.median(r["quality"][name] for r in results) for name in results[0]["quality"]}


def _paired(numerators, denominators, combine) -> dict:
    """Per quality, the median over rounds of combine(numerator's, denominator's) within each round."""
    return {name: statistics.median(combine(a["quality"][name], b["quality"][name])
                                    for a, b in zip(numerators, denominators)) for name in numerators[0]["quality"]}


def _paired_ratio(numerators, denominators) -> float:
    """The median over rounds of the examples/s ratio within each round: noise that hits a whole round cancels."""
    return statistics.median(a["examples_per_second"] / b["examples_per_second"]
                             for a, b in zip(numerators, denominators))


def measure(examples, scales, epochs, repeats, precisions, keras_threads, replica_counts=REPLICAS) -> dict:
    """Every combination once per round, interleaved; the report with per-round results and medians."""
    runnable = [(e, p) for e in examples for p in precisions if (e, p) not in CANNOT_RUN]
    runs = {(e, r, p, n): [] for e, p in runnable for r in replica_counts for n in RUNNERS}
    started = time.perf_counter()
    flops = {example: run_worker(f"flops,{example}")["flops_per_example"] for example in examples}
    peaks = []
    for round_ in range(repeats):
        peaks.append(run_worker("peak"))
        order = RUNNERS if round_ % 2 == 0 else RUNNERS[::-1]  # no runner always goes first
        for example in examples:
            for replicas in replica_counts:
                for precision in precisions:
                    for runner in order if (example, precision) in runnable else ():
                        if runner == "tuned" and precision not in TUNED_PRECISIONS:
                            continue
                        result = run_one(example, runner, replicas, precision, round_, scales[example], epochs,
                                         keras_threads)
                        runs[(example, replicas, precision, runner)].append(result)
                        print(f"round {round_ + 1}/{repeats}  {example} x{replicas} {precision}  {NAMES[runner]}: "
                              + _said(result), flush=True)
    peak = {p: statistics.median(round_[p] for round_ in peaks) for p in PRECISIONS}
    rows = []
    for example in examples:
        for replicas in replica_counts:
            for precision in precisions:
                row = {"example": example, "kind": KINDS[example], "replicas": replicas, "precision": precision}
                if (example, precision) not in runnable:
                    rows.append({**row, "cannot_run": CANNOT_RUN[(example, precision)]})
                    continue
                fit, ours = runs[(example, replicas, precision, "fit")], runs[(example, replicas, precision, "gpupar")]
                tuned = runs[(example, replicas, precision, "tuned")]
                best = _best(fit, tuned)
                rows.append({
                    **row, **_limits({"fit": fit, "best": best, "gpupar": ours}, flops[example], peak[precision]),
                    **_tuned(tuned, best, ours),
                    "metrics": list(fit[0]["quality"]),
                    "fit_quality": _medians(fit), "gpupar_quality": _medians(ours),
                    "difference": _paired(ours, fit, lambda o, f: o - f),
                    "fit_examples_per_second": statistics.median(r["examples_per_second"] for r in fit),
                    "gpupar_examples_per_second": statistics.median(r["examples_per_second"] for r in ours),
                    "ratio": _paired_ratio(ours, fit),
                    "train_examples": fit[0]["train_examples"], "val_examples": fit[0]["val_examples"],
                    "rounds": [{"model.fit": f, "gpupar.fit": o, **({NAMES["tuned"]: t} if tuned else {})}
                               for f, o, t in zip(fit, ours, tuned or fit)],
                })
    bfloat16 = []
    for example in examples if set(PRECISIONS) <= set(precisions) else ():
        for replicas in replica_counts:
            for runner in (r for r in RUNNERS if r != "tuned"):  # the tuned runs are float32 alone
                row = {"example": example, "replicas": replicas, "runner": NAMES[runner]}
                if (example, "mixed_bfloat16") not in runnable:
                    bfloat16.append({**row, "cannot_run": CANNOT_RUN[(example, "mixed_bfloat16")]})
                    continue
                plain, fast = (runs[(example, replicas, p, runner)] for p in PRECISIONS)
                bfloat16.append({
                    **row, "metrics": list(plain[0]["quality"]),
                    **{f"{name}_limit": statistics.median(r["examples_per_second"] for r in results)
                       * flops[example] / peak[p] for name, p, results in zip(("float32", "bfloat16"), PRECISIONS,
                                                                             (plain, fast))},
                    "float32_examples_per_second": statistics.median(r["examples_per_second"] for r in plain),
                    "bfloat16_examples_per_second": statistics.median(r["examples_per_second"] for r in fast),
                    "ratio": _paired_ratio(fast, plain),
                    "float32_quality": _medians(plain), "bfloat16_quality": _medians(fast),
                    "difference": _paired(fast, plain, lambda b, f: b - f),
                })
    return {"scales": {e: scales[e] for e in examples}, "epochs": epochs, "repeats": repeats,
            "flops_per_example": flops, "peak_flops_per_second": peak, "peaks": peaks,
            "precisions": list(precisions), "keras_threads": keras_threads,
            "seconds": time.perf_counter() - started, "rows": rows, "bfloat16": bfloat16}


def _values(values: dict, signed=False) -> str:
    """A cell of one or more qualities: 0.9812, or 0.6931 / 0.7120 for a GAN's d_loss / g_loss."""
    return " / ".join(f"{v:+.4f}" if signed else f"{v:.4f}" for v in values.values())


def _compared(row: dict, first: str, second: str) -> str:
    """The cells comparing a row's `first` and `second` runs: quality of each, difference, examples/s of each, ratio."""
    return (f"| {' / '.join(row['metrics'])} | {_values(row[first + '_quality'])} "
            f"| {_values(row[second + '_quality'])} | {_values(row['difference'], signed=True)} "
            f"| {row[first + '_examples_per_second']:,.0f} | {row[second + '_examples_per_second']:,.0f} "
            f"| {row['ratio']:.2f}x |")


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def _best_table(rows) -> list:
    """Markdown lines: gpupar.fit against model.fit at its defaults and at its best, where both ran (float32), with
    how close each ran to the machine's limit."""
    tuned = NAMES["tuned"]
    lines = ["", f"| program | replicas | model.fit ex/s | {tuned} ex/s | gpupar.fit ex/s | gpupar / best model.fit "
             "| quality diff | limit: best model.fit | limit: gpupar.fit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    failures = {}
    for row in rows:
        if "best_ratio" not in row:
            continue
        if "tuned_failed" in row:
            mark = failures.setdefault(row["tuned_failed"], "†" * (len(failures) + 1))
            tuned_cells, difference = f"fails{mark}", row["difference"]
        else:
            tuned_cells, difference = f"{row['tuned_examples_per_second']:,.0f}", row["tuned_difference"]
        lines.append(f"| {row['example']} | {row['replicas']} | {row['fit_examples_per_second']:,.0f} | {tuned_cells} "
                     f"| {row['gpupar_examples_per_second']:,.0f} | {row['best_ratio']:.2f}x "
                     f"| {_values(difference, signed=True)} | {_percent(row['best_limit'])} | {_percent(row['gpupar_limit'])} |")
    lines += [f"{mark} {tuned} fails here: {error}; the best model.fit that runs is its default, one step per call."
              for error, mark in failures.items()]
    lines.append(f"gpupar / best model.fit: the median over rounds of gpupar.fit's examples/s over the faster of "
                 f"model.fit's two runs in that round; quality diff: gpupar.fit - {tuned} (- model.fit where that "
                 "fails).")
    return lines if len(lines) > 3 else []


def table(report) -> str:
    """The report as markdown: gpupar.fit against model.fit per program, replicas and precision; gpupar.fit against
    model.fit at its best; then bfloat16 against float32 per program, replicas and runner; then what the figures
    are."""
    lines = ["| program | kind | replicas | precision | quality | model.fit | gpupar.fit | diff | model.fit ex/s "
             "| gpupar.fit ex/s | gpupar/fit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    cannot_run = {}
    for row in report["rows"]:
        head = f"| {row['example']} | {row['kind']} | {row['replicas']} | {row['precision']} "
        if "cannot_run" in row:
            mark = cannot_run.setdefault(row["cannot_run"], "*" * (len(cannot_run) + 1))
            lines.append(head + f"| cannot run{mark} | | | | | | |")
            continue
        lines.append(head + _compared(row, "fit", "gpupar"))
    lines += _best_table(report["rows"])
    if report["bfloat16"]:
        lines += ["", "| program | replicas | runner | quality | float32 | bfloat16 | diff | float32 ex/s "
                  "| bfloat16 ex/s | bf16/f32 | limit: float32 | limit: bfloat16 |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in report["bfloat16"]:
            head = f"| {row['example']} | {row['replicas']} | {row['runner']} "
            if "cannot_run" in row:
                lines.append(head + f"| cannot run{cannot_run[row['cannot_run']]} | | | | | | | | |")
                continue
            lines.append(head + _compared(row, "float32", "bfloat16")
                         + f" {_percent(row['float32_limit'])} | {_percent(row['bfloat16_limit'])} |")
    scales = ", ".join(f"{e} {s}" for e, s in report["scales"].items())
    lines += ["", f"Medians over {report['repeats']} round(s); data scale {scales}; {report['epochs']} epochs, "
              f"examples/s over epochs 2-{report['epochs']}; diff = gpupar.fit - model.fit (in the second table "
              f"bfloat16 - float32); quality: the last epoch's validation accuracy, the validation loss where the "
              f"program has no accuracy (segmentation), the GAN's last logged d_loss / g_loss (it has no validation "
              f"and no accuracy; at 2 replicas both runners log them at half the 1-replica value, Keras' loss "
              f"objects dividing by the replica count); {report['seconds']:.0f} s in all."]
    lines += [f"{mark} {reason}" for reason, mark in cannot_run.items()]
    peak = report["peak_flops_per_second"]
    lines.append("limit: examples/s x the program's training FLOPs per example (benchmarks/roofline.py, matrix "
                 "operations of one train_step: " + ", ".join(f"{e} {f / 1e6:,.1f} MFLOP"
                                                              for e, f in report["flops_per_example"].items())
                 + f") over this machine's matrix-multiply rate in the precision it ran in (float32 "
                 f"{peak['float32'] / 1e9:,.0f} GFLOP/s, bfloat16 {peak['mixed_bfloat16'] / 1e9:,.0f} GFLOP/s, medians "
                 f"of {len(report['peaks'])} measurement(s)); best model.fit: the faster of its two runs in each round.")
    if report["quick"]:
        sizes = ", ".join(sorted({str(r["val_examples"]) for r in report["rows"] if r.get("val_examples")}, key=int))
        lines.append(f"--quick: the tests' tiny data ({sizes} validation examples) and 2 epochs: a smoke test, "
                     "its figures are no comparison.")
    for row in report["rows"]:
        for name, difference in row.get("difference", {}).items():
            if name.endswith("accuracy") and abs(difference) > 0.015:
                lines.append(f"note: {row['example']} x{row['replicas']} {row['precision']}: {name} differs by "
                             f"{difference:+.4f} (per round: " + ", ".join(
                                 f"{r['model.fit']['quality'][name]:.4f} vs {r['gpupar.fit']['quality'][name]:.4f}"
                                 for r in row["rounds"]) + ")")
    return "\n".join(lines)


def main() -> int:
    """The driver (or, with --worker, one combination)."""
    task = FLAGS.worker.split(",") if FLAGS.worker else None
    if task == ["peak"]:
        measure_peak()
        return 0
    if task and task[0] == "flops":
        count_flops(task[1])
        return 0
    if task:
        example, runner, replicas, precision, seed = task
        work(example, runner, int(replicas), precision, int(seed), FLAGS.scale, FLAGS.epochs, FLAGS.keras_threads)
        return 0
    unknown = sorted(set(FLAGS.examples) - set(EXAMPLES))
    if unknown:
        raise script.UsageError(f"--examples: unknown {', '.join(unknown)}; choose from {', '.join(EXAMPLES)}")
    precisions = [p for p in PRECISIONS if p in FLAGS.precisions]  # float32 first, whatever the order given
    if sorted(precisions) != sorted(set(FLAGS.precisions)) or not precisions:
        raise script.UsageError(f"--precisions={','.join(FLAGS.precisions)}: choose from {', '.join(PRECISIONS)}")
    replica_counts = tuple(r for r in REPLICAS if str(r) in FLAGS.replicas)
    if sorted(map(str, replica_counts)) != sorted(set(FLAGS.replicas)) or not replica_counts:
        raise script.UsageError(f"--replicas={','.join(FLAGS.replicas)}: choose from {', '.join(map(str, REPLICAS))}")
    settings = dict(QUICK) if FLAGS.quick else {"scale": FLAGS.scale, "epochs": FLAGS.epochs, "repeats": FLAGS.repeats}
    scale = settings.pop("scale")
    scales = {example: scale or SCALES[example] for example in FLAGS.examples}
    report = {"quick": FLAGS.quick, **measure(FLAGS.examples, scales, precisions=precisions,
                                              keras_threads=FLAGS.keras_threads, replica_counts=replica_counts,
                                              **settings)}
    print(table(report))
    if FLAGS.json:
        script.write_json(FLAGS.json, report)
    return 0


if __name__ == "__main__":
    script.run("benchmarks.keras_io", define_flags, main)
