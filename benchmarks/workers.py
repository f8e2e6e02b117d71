"""One benchmark configuration in a process of its own, timed when benchmarks/bench.py says so.

    python -m benchmarks.workers --runner=gpupar --replicas=2 --data_dir=/usr/share/datasets/fashion-mnist \
        --batch_size=1024 --steps=20 --options='{"jit_compile": true}'

Thread pools, virtual CPUs and dtype policies are fixed once TensorFlow starts, so every
configuration gets a process. It sets up, runs one untimed call and prints a `BENCH {...}` line
(seconds from process start to the end of the first step, the strategy); then for each line on
stdin: `run` times `steps` steps and prints their images/s (and, for gpupar, the seconds spent
waiting for input, in the steps and on the host); `profile DIR` (gpupar only) does the same under
the TensorBoard profiler and adds the op time by kind; `quit` prints the peak memory and exits.

Runners: `gpupar` (gpupar's trainer with Config options), `fit` (Keras model.fit on the same
model, data and strategy; options: steps_per_execution, gpupar_threads, keras_batch_norm: the
ConvNet with Keras' own BatchNormalization, as plain Keras code has it); for both, the option
user_model trains benchmarks/user_model.py's CNN instead (gpupar through gpupar.fit's path), `towers` (the classic
TF1 tower code of benchmarks/towers.py, a tower per replica) and `matmul` (the float32 and
bfloat16 matrix-multiply rates, for the roofline).
"""

import json
import os
import resource
import sys
import time

STARTED = time.perf_counter()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

from benchmarks import script  # noqa: E402

FLAGS = flags.FLAGS


def say(**values):
    """One result line for the driver."""
    print("BENCH " + json.dumps(values), flush=True)


def commands():
    """The driver's commands, one per stdin line, until `quit`."""
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            return
        yield command


def cpu_seconds() -> float:
    """CPU time this process has used, all threads, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_memory_mb() -> dict:
    """Peak resident host memory of this process, and of GPU:0 where there is one."""
    import tensorflow as tf

    peak = {"host_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if tf.config.list_logical_devices("GPU"):
        peak["gpu_mb"] = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
    return peak


def _profiled(directory, run):
    import tensorflow as tf

    tf.profiler.experimental.start(directory)
    try:
        return run()
    finally:
        tf.profiler.experimental.stop()


def serve(run_steps, steps, on_profile=None):
    """Answers the driver's commands with run_steps(steps) -> dict of results."""
    for command in commands():
        if command[0] == "run":
            say(**run_steps(steps))
        elif command[0] == "profile":
            results = _profiled(command[1], lambda: run_steps(steps))
            say(**results, **(on_profile(command[1]) if on_profile else {}))
    say(peak_memory=peak_memory_mb())


def gpupar_runner(spec):
    """gpupar's trainer, set up as gpupar.fit_mnist would: calls of steps_per_call steps."""
    from benchmarks.ops import op_seconds
    from benchmarks.user_model import user_cnn, user_loss
    from gpupar.data.adapters import adapter_for
    from gpupar.data.idx import load_idx_dir
    from gpupar.presets.mnist import mnist_run
    from gpupar.presets.mnist_options import mnist_options
    from gpupar.training.setup import build_trainer
    from gpupar.training.task import user_task

    replicas, options = spec["replicas"], dict(spec["options"])
    user = options.pop("user_model", False)
    config, task, mode = mnist_run(*mnist_options(options=dict(
        dataset="fashion_mnist", data_dir=spec["data_dir"], per_replica_batch_size=spec["batch_size"],
        virtual_cpus=replicas if replicas > 1 else None, **options)))
    if user:  # the user CNN through gpupar.fit's own path
        splits = load_idx_dir(spec["data_dir"])
        task = user_task(user_cnn, adapter_for(splits.train_images, splits.train_labels), None, user_loss(),
                         ["accuracy"], None, ())
    trainer = build_trainer(config, task, mode)
    if trainer.replicas != replicas:
        raise SystemExit(f"benchmarks.workers: asked for {replicas} replicas, got {trainer.description}")
    iterator = trainer.start(0)
    trainer.run_calls(iterator, 1, first_call=True)
    say(first_step_seconds=time.perf_counter() - STARTED, strategy=";".join(trainer.description.split(";")[:2]),
        steps_per_call=trainer.steps_per_call)
    trainer.run_calls(iterator, trainer.steps_per_call)  # a full-size call, untimed

    def timed(steps):
        started, cpu = time.perf_counter(), cpu_seconds()
        results = trainer.run_calls(iterator, steps)
        seconds = time.perf_counter() - started
        return {"images_per_second": steps * trainer.global_batch / seconds, "input_wait_seconds": results.waited,
                "step_seconds": results.busy, "host_seconds": seconds - results.waited - results.busy,
                "seconds": seconds, "cores_busy": (cpu_seconds() - cpu) / seconds}

    serve(timed, spec["steps"], on_profile=lambda directory: {"op_seconds": op_seconds(directory)})


def fit_runner(spec):
    """Keras model.fit on gpupar's model, pipeline and strategy: one fit call, an epoch per timed run."""
    import keras
    import tensorflow as tf

    from gpupar.data import array_pipeline as pipeline, mnist_images as mnist
    from gpupar.runtime.devices import plan_threads
    from gpupar.data.idx import load_idx_dir
    from gpupar.models.convnet import build_convnet
    from benchmarks.user_model import user_cnn
    from gpupar.runtime.strategy import build_strategy, detected_plan

    replicas, options = spec["replicas"], spec["options"]
    if options.get("gpupar_threads"):
        intra, inter = plan_threads(len(os.sched_getaffinity(0)), 0, replicas)
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    if replicas > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    plan = detected_plan("auto", max_cpus=replicas)
    strategy = build_strategy(plan)
    splits = load_idx_dir(spec["data_dir"])
    global_batch = spec["batch_size"] * replicas
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = user_cnn() if options.get("user_model") else build_convnet(
            xla_batch_norm=not options.get("keras_batch_norm"))
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                      steps_per_execution=options.get("steps_per_execution", 1))

    class Driven(keras.callbacks.Callback):
        """Epoch 0 warms up; every later epoch is one timed run, started by the driver's command."""

        def __init__(self):
            super().__init__()
            self.commands, self.first = commands(), True

        def on_train_batch_end(self, batch, logs=None):
            if self.first:
                say(first_step_seconds=time.perf_counter() - STARTED, strategy=";".join(plan.describe().split(";")[:2]),
                    steps_per_call=options.get("steps_per_execution", 1))
                self.first = False

        def on_epoch_begin(self, epoch, logs=None):
            if epoch > 0:
                command = next(self.commands, None)
                if command is None:
                    say(peak_memory=peak_memory_mb())
                    sys.stdout.flush()
                    os._exit(0)  # leaves fit (and its iterator) without waiting for its teardown
            self.started, self.cpu = time.perf_counter(), cpu_seconds()

        def on_epoch_end(self, epoch, logs=None):  # Keras has waited for the device by now
            seconds = time.perf_counter() - self.started
            if epoch > 0:
                say(images_per_second=spec["steps"] * global_batch / seconds, seconds=seconds,
                    cores_busy=(cpu_seconds() - self.cpu) / seconds)

    # The same input pipeline as gpupar's: for the user CNN the uint8 images, which it rescales itself.
    dataset = pipeline.train_dataset((splits.train_images, splits.train_labels), global_batch, 0)
    if not options.get("user_model"):
        dataset = dataset.map(mnist.normalise)
    model.fit(dataset, epochs=10**9, steps_per_epoch=spec["steps"], callbacks=[Driven()], verbose=0)


def matmul_runner(spec):
    """The float32 and bfloat16 matrix-multiply rates, measured again at every run, and the ConvNet's FLOPs."""
    import keras
    import numpy as np
    import tensorflow as tf

    from gpupar.models.convnet import build_convnet
    from benchmarks.roofline import matmul_flops_per_second, step_flops_per_example

    # The ConvNet fit one step on a zero batch: built with its optimizer, as step_flops_per_example needs.
    model = build_convnet()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = (np.zeros((8, 28, 28, 1), "float32"), np.zeros((8,), "int32"))
    model.fit(*batch, batch_size=8, verbose=0)
    say(first_step_seconds=time.perf_counter() - STARTED, strategy="matmul 2048x2048", steps_per_call=1,
        flops_per_image=step_flops_per_example(model, batch))
    serve(lambda _: {"float32_flops": matmul_flops_per_second(tf.float32),
                     "bfloat16_flops": matmul_flops_per_second(tf.bfloat16)}, spec["steps"])


def towers_runner(spec):
    """The classic TF1 tower code (gpupar.towers), one tower per replica, fed a shuffled pass at a time."""
    import numpy as np
    import tensorflow as tf

    from gpupar.data.idx import load_idx_dir
    from benchmarks.towers import TowerTrainer

    towers, batch = spec["replicas"], spec["batch_size"]
    num_gpus = len(tf.config.list_physical_devices("GPU"))
    trainer = TowerTrainer(towers, batch, num_gpus=num_gpus)
    splits = load_idx_dir(spec["data_dir"])
    images = (splits.train_images.astype(np.float32) / 255.0)[..., np.newaxis]
    labels = splits.train_labels.astype(np.int64)
    global_batch = towers * batch
    rng = np.random.default_rng(0)

    def batches():
        while True:
            order = rng.permutation(len(images))
            for start in range(0, len(order) - global_batch + 1, global_batch):
                chosen = order[start:start + global_batch]
                yield images[chosen], labels[chosen]

    feed = batches()
    trainer.step(*next(feed))
    say(first_step_seconds=time.perf_counter() - STARTED, strategy=f"TF1 towers on {', '.join(trainer.devices)}",
        steps_per_call=1)
    for _ in range(10):  # untimed, as gpupar's runner does a full call
        trainer.step(*next(feed))

    def timed(steps):
        started, cpu = time.perf_counter(), cpu_seconds()
        for _ in range(steps):
            trainer.step(*next(feed))
        seconds = time.perf_counter() - started
        return {"images_per_second": steps * global_batch / seconds, "seconds": seconds,
                "cores_busy": (cpu_seconds() - cpu) / seconds}

    serve(timed, spec["steps"])


RUNNERS = {"gpupar": gpupar_runner, "fit": fit_runner, "towers": towers_runner, "matmul": matmul_runner}


def define_flags():
    """The worker's flags: which configuration it runs."""
    flags.DEFINE_enum("runner", None, list(RUNNERS), "What to run.", required=True)
    flags.DEFINE_integer("replicas", 1, "Data-parallel replicas (virtual CPUs without GPUs).", lower_bound=1)
    flags.DEFINE_string("data_dir", script.DEFAULT_DATA_DIR, "Fashion-MNIST IDX folder.")
    flags.DEFINE_integer("batch_size", 1024, "Examples per replica per step.", lower_bound=1)
    flags.DEFINE_integer("steps", 20, "Steps per timed run.", lower_bound=1)
    flags.DEFINE_string("options", "{}", "The configuration's options as a JSON object (Config fields for gpupar).")


def main() -> int:
    """Runs the configuration the flags name, answering the driver's commands on stdin."""
    spec = {"runner": FLAGS.runner, "replicas": FLAGS.replicas, "data_dir": FLAGS.data_dir,
            "batch_size": FLAGS.batch_size, "steps": FLAGS.steps, "options": json.loads(FLAGS.options)}
    RUNNERS[spec["runner"]](spec)
    return 0


if __name__ == "__main__":
    script.run("benchmarks.workers", define_flags, main)
