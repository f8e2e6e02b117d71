"""A model's own train_step (a DCGAN-like GAN) trained by gpupar.fit and by Keras' model.fit, at 1 and 2 replicas.

    python -m benchmarks.own_step                                   # 4,096 images, 4 epochs, 2 rounds
    python -m benchmarks.own_step --quick --json=/tmp/own_step.json # 512 images, 2 epochs, 1 round
    python benchmarks/own_step.py --examples=8192 --epochs=3 --rounds=3

The model is keras-io's dcgan_overriding_train_step GAN class, unchanged, from its port in
tests/keras_io/dcgan_overriding_train_step.py (compile(d_optimizer, g_optimizer, loss_fn) keeping
both optimizers as attributes, d_loss/g_loss Mean trackers, latent vectors from
keras.random.normal with a SeedGenerator, the discriminator's update then the generator's, label
noise from tf.random.uniform), with a conv discriminator and generator of this file's own for
28x28x1 images and a latent vector of 32 (Adam 1e-4 each, BinaryCrossentropy on sigmoid outputs).
Data: --examples synthetic images (a bright disc on a dark, noisy background, float32 in [0, 1],
the same in every process), global batch 64, --epochs epochs.

- gpupar.fit: gpupar.fit(model_fn, images, batch_size=64, ...) with strategy="one_device" at 1
  replica and strategy="mirrored", virtual_cpus=2 at 2, the model as written; gpupar runs its
  train_step on each replica, steps_per_call (10) steps per tf.function call.
- model.fit: the same model_fn's model with no strategy at 1 replica (as written), and built and
  compiled in MirroredStrategy(["/cpu:0", "/cpu:1"])'s scope at 2, over the virtual CPUs that
  gpupar.configure_devices(virtual_cpus=2) makes (as for gpupar.fit). There model.fit cannot run
  the GAN as written: the class has no call(), so fit calls it to build the model and fails, and
  its Adam optimizers build their slots lazily inside the replicated step, which fails under
  MirroredStrategy ("You must feed a value for placeholder tensor"). The minimal workaround, on
  the model.fit row at 2 replicas only: `gan.built = True`, then
  d_optimizer.build(discriminator.trainable_variables) and g_optimizer.build(generator.
  trainable_variables), in the strategy's scope before fit. model.fit runs with the GAN's own
  compile (steps_per_execution 1, as keras-io writes it): with 10 (gpupar's K), Keras 3.15's fit
  fails under this MirroredStrategy (whose inferred all-reduce on CPUs is CollectiveAllReduce)
  with the same placeholder error, a plain Sequential model too; with ReductionToOneDevice it runs,
  at the speed of steps_per_execution 1 here.

Every (runner, replicas) combination trains in a fresh process (virtual CPUs and thread pools are
fixed once TensorFlow starts), one after another, interleaved over --rounds rounds with the
runners' order alternating; each round seeds both runners with its number (gpupar.fit's seed=,
keras.utils.set_random_seed for model.fit). Measured, as benchmarks/keras_io.py does: the first
epoch's seconds (tracing included), and training examples/s over the epochs after the first (the
steady state): model.fit's from a callback's clock (on_epoch_begin to on_epoch_end), gpupar.fit's
from its records (the epoch's steps: its setup before them, model_fn and a trace of the step that
builds the optimizers, is not in them; each run's fit_seconds in the JSON is its whole fit call).
The table gives the best over the rounds (the fewest first-epoch seconds, the most examples/s)
and the ratio of the best gpupar.fit to the best model.fit at the same replicas.

What differs besides the speed: at 2 replicas gpupar draws other latent vectors (and dropout
masks) on each replica, while model.fit under MirroredStrategy draws the same latent vectors on
both (the SeedGenerator's state is one mirrored variable); the unseeded tf.random.uniform label
noise differs per replica under both. Under both, the d_loss and g_loss the step logs at 2
replicas read half the 1-replica value: Keras' loss objects divide by the replica count.
"""

import json
import os
import subprocess
import sys
import time
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __package__ in (None, ""):  # run as a file: the repository's root is the package's
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from benchmarks import script  # noqa: E402
from benchmarks.keras_io import NAMES, REPLICAS, RUNNERS, gpupar_fit, keras_fit, mirrored_fit_ready, rate  # noqa: E402

FLAGS = flags.FLAGS

SIZE, LATENT, BATCH = 28, 32, 64  # image side (28x28x1), latent vector, global batch
QUICK = {"examples": 512, "epochs": 2, "rounds": 1}
RESULT = "OWN_STEP "  # the worker's result line
CONFIGURATIONS = {("gpupar", 1): 'gpupar.fit strategy="one_device"', ("fit", 1): "model.fit, no strategy",
                  ("gpupar", 2): 'gpupar.fit strategy="mirrored"', ("fit", 2): "model.fit, MirroredStrategy+workaround"}


def define_flags():
    """The benchmark's flags, and the worker's."""
    flags.DEFINE_integer("examples", 4096, "Synthetic training images.", lower_bound=BATCH)
    flags.DEFINE_integer("epochs", 4, "Epochs of every fit (at least 2: the first is not in the steady rate).",
                         lower_bound=2)
    flags.DEFINE_integer("rounds", 2, "Rounds: every combination trains once per round; the table keeps the best.",
                         lower_bound=1)
    flags.DEFINE_bool("quick", False, "512 images, 2 epochs, 1 round: a smoke test of a minute or two.")
    flags.DEFINE_string("json", "runs/own_step.json", "Write the results here; empty for none.")
    flags.DEFINE_string("worker", None, "Internal: run one combination, RUNNER,REPLICAS,SEED, and print its result.")


# ---------------------------------------------------------------------------------------------
# The worker: one (runner, replicas) fit in this process.


def images(num: int):
    """num float32 (28, 28, 1) images in [0, 1]: a bright disc at a random place on dark noise, the same every call."""
    import numpy as np

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    cy, cx = rng.uniform(8, SIZE - 8, size=(2, num, 1, 1))
    radius, brightness = rng.uniform(4, 9, size=(num, 1, 1)), rng.uniform(0.6, 1.0, size=(num, 1, 1))
    disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= radius ** 2
    noisy = disc * brightness + rng.normal(0.0, 0.05, size=(num, SIZE, SIZE))
    return np.clip(noisy, 0.0, 1.0)[..., None].astype("float32")


def model_fn():
    """keras-io's DCGAN class (tests/keras_io's port must be importable) on a conv pair for 28x28x1, compiled."""
    import keras
    from keras import layers
    from keras_io.dcgan_overriding_train_step import GAN

    def conv(Layer, filters):  # a stride-2 conv (or transposed conv) and LeakyReLU, as keras-io's DCGAN
        return [Layer(filters, kernel_size=4, strides=2, padding="same"), layers.LeakyReLU(negative_slope=0.2)]

    discriminator = keras.Sequential(
        [keras.Input((SIZE, SIZE, 1)), *conv(layers.Conv2D, 32), *conv(layers.Conv2D, 64),
         layers.Flatten(), layers.Dropout(0.2), layers.Dense(1, activation="sigmoid")], name="discriminator")
    generator = keras.Sequential(
        [keras.Input((LATENT,)), layers.Dense(7 * 7 * 64), layers.Reshape((7, 7, 64)),
         *conv(layers.Conv2DTranspose, 64), *conv(layers.Conv2DTranspose, 32),
         layers.Conv2D(1, kernel_size=5, padding="same", activation="sigmoid")], name="generator")
    gan = GAN(discriminator=discriminator, generator=generator, latent_dim=LATENT)
    gan.compile(d_optimizer=keras.optimizers.Adam(1e-4), g_optimizer=keras.optimizers.Adam(1e-4),
                loss_fn=keras.losses.BinaryCrossentropy())
    return gan


def keras_model_fn(replicas: int):
    """model_fn for model.fit: at 2 replicas with the workaround MirroredStrategy needs (keras_fit calls it in the
    strategy's scope)."""
    return (lambda: mirrored_fit_ready(model_fn())) if replicas > 1 else model_fn


def work(runner: str, replicas: int, seed: int, examples: int, epochs: int):
    """Trains one combination in this fresh process and prints its RESULT line."""
    started = time.perf_counter()
    if replicas > 1:  # before anything starts TensorFlow; both runners get gpupar's virtual CPUs and thread pools
        import gpupar

        gpupar.configure_devices(virtual_cpus=replicas)
    import keras

    sys.path.insert(0, os.path.join(script.ROOT, "tests"))  # keras-io's GAN is the tests' keras_io port
    if runner == "fit":
        fit = keras_fit(types.SimpleNamespace(model_fn=keras_model_fn(replicas)), replicas)
    else:
        fit = gpupar_fit(types.SimpleNamespace(model_fn=model_fn), replicas, seed)
    x = images(examples)
    keras.utils.set_random_seed(seed)
    fit_started = time.perf_counter()
    history, trained, seconds, _ = fit(x, batch_size=BATCH, epochs=epochs)
    print(RESULT + json.dumps({
        "first_epoch_seconds": seconds[0], "examples_per_second": rate(trained, seconds),
        "epoch_examples_per_second": [e / s for e, s in zip(trained, seconds)], "epoch_seconds": seconds,
        "d_loss": [float(v) for v in history["d_loss"]], "g_loss": [float(v) for v in history["g_loss"]],
        "fit_seconds": time.perf_counter() - fit_started, "process_seconds": time.perf_counter() - started,
    }), flush=True)


# ---------------------------------------------------------------------------------------------
# The driver: every combination in a process of its own, round after round.


def run_one(runner, replicas, seed, settings) -> dict:
    """Starts a worker process for one combination and returns its result."""
    command = [sys.executable, "-m", "benchmarks.own_step", f"--worker={runner},{replicas},{seed}", "--json="]
    command += [f"--examples={settings['examples']}", f"--epochs={settings['epochs']}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=script.ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise RuntimeError(f"benchmarks.own_step: {NAMES[runner]} x{replicas} failed (status {done.returncode})")
    return json.loads(lines[-1][len(RESULT):])


def measure(settings) -> dict:
    """Every combination once per round, interleaved; the report with per-round results and the best of each."""
    runs = {(runner, replicas): [] for replicas in REPLICAS for runner in RUNNERS}
    started = time.perf_counter()
    for round_ in range(settings["rounds"]):
        order = RUNNERS if round_ % 2 == 0 else RUNNERS[::-1]  # neither runner always goes first
        for replicas in REPLICAS:
            for runner in order:
                result = run_one(runner, replicas, round_, settings)
                runs[(runner, replicas)].append(result)
                print(f"round {round_ + 1}/{settings['rounds']}  {NAMES[runner]} x{replicas}: first epoch "
                      f"{result['first_epoch_seconds']:.1f} s, {result['examples_per_second']:,.0f} examples/s, "
                      f"{result['process_seconds']:.0f} s", flush=True)
    best = {key: max(r["examples_per_second"] for r in results) for key, results in runs.items()}
    rows = [{"configuration": CONFIGURATIONS[(runner, replicas)], "runner": NAMES[runner], "replicas": replicas,
             "first_epoch_seconds": min(r["first_epoch_seconds"] for r in runs[(runner, replicas)]),
             "examples_per_second": best[(runner, replicas)],
             "ratio": best[("gpupar", replicas)] / best[("fit", replicas)] if runner == "gpupar" else None,
             "rounds": runs[(runner, replicas)]}
            for replicas in REPLICAS for runner in ("gpupar", "fit")]
    return {**settings, "batch_size": BATCH, "seconds": time.perf_counter() - started, "rows": rows}


def table(report) -> str:
    """The report as markdown: a row per runner and replicas, then what the figures are."""
    lines = ["| configuration | replicas | 1st epoch s | steady ex/s | gpupar/fit | d_loss | g_loss |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["rows"]:
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else ""
        best = max(row["rounds"], key=lambda r: r["examples_per_second"])  # the round whose rate the row shows
        lines.append(f"| {row['configuration']} | {row['replicas']} | {row['first_epoch_seconds']:.1f} "
                     f"| {row['examples_per_second']:,.0f} | {ratio} | {best['d_loss'][-1]:.4f} "
                     f"| {best['g_loss'][-1]:.4f} |")
    lines += ["", f"Best of {report['rounds']} round(s); {report['examples']:,} images, batch {report['batch_size']}, "
              f"{report['epochs']} epochs, examples/s over epochs 2-{report['epochs']}; d_loss and g_loss: the last "
              f"epoch's, of the row's best round (at 2 replicas half the 1-replica value: Keras' loss objects divide "
              f"by the replica count); {report['seconds']:.0f} s in all."]
    if report["quick"]:
        lines.append("--quick: a smoke test; its few steps per epoch make the rates no comparison.")
    return "\n".join(lines)


def main() -> int:
    """The driver (or, with --worker, one combination)."""
    if FLAGS.worker:
        runner, replicas, seed = FLAGS.worker.split(",")
        work(runner, int(replicas), int(seed), FLAGS.examples, FLAGS.epochs)
        return 0
    settings = dict(QUICK) if FLAGS.quick else {"examples": FLAGS.examples, "epochs": FLAGS.epochs,
                                                "rounds": FLAGS.rounds}
    report = {"quick": FLAGS.quick, **measure(settings)}
    print(table(report))
    if FLAGS.json:
        script.write_json(FLAGS.json, report)
    return 0


if __name__ == "__main__":
    script.run("benchmarks.own_step", define_flags, main)
