"""A user's CNN trained by gpupar.fit and by Keras' model.fit, the same model, data, epochs and replicas.

    python -m benchmarks.versus_fit                            # 2 virtual CPUs, 3 epochs of Fashion-MNIST
    python benchmarks/versus_fit.py --epochs=1 --json=runs/versus_fit.json

Both train benchmarks/user_model.py's CNN with Adam(1e-3) under MirroredStrategy on two
replicas, batch 128 per replica, and evaluate on the test set after every epoch; the table gives
each epoch's test accuracy and the seconds of the whole fit. Their data orders differ (gpupar's
seeded permutation, model.fit's own shuffle), so the accuracies are two runs of the same recipe.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __package__ in (None, ""):  # run as a file: the repository's root is the package's
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from benchmarks import script  # noqa: E402

FLAGS = flags.FLAGS
REPLICAS, BATCH = 2, 128


def define_flags():
    """The comparison's flags."""
    flags.DEFINE_string("data_dir", None, f"Fashion-MNIST IDX folder; empty: {script.DEFAULT_DATA_DIR}.")
    flags.DEFINE_integer("epochs", 3, "Epochs of each fit.", lower_bound=1)
    flags.DEFINE_string("json", "runs/versus_fit.json", "Write the results here; empty for none.")


def compare(data_dir: str, epochs: int, steps_per_epoch=None) -> dict:
    """Trains the user CNN both ways; {"gpupar.fit": ..., "model.fit": ...} with accuracies per epoch and seconds.

    The process must not have started TensorFlow's devices: it splits the CPU into two virtual devices.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import gpupar
    from benchmarks.user_model import user_cnn, user_loss
    from gpupar.data.idx import load_idx_dir

    gpupar.configure_devices(virtual_cpus=REPLICAS)
    data = load_idx_dir(data_dir)
    train, test = (data.train_images, data.train_labels), (data.test_images, data.test_labels)
    started = time.perf_counter()
    result = gpupar.fit(user_cnn, *train, validation_data=test, loss=user_loss(), metrics=["accuracy"],
                        strategy="mirrored", virtual_cpus=REPLICAS, batch_size=BATCH * REPLICAS, epochs=epochs,
                        steps_per_epoch=steps_per_epoch, save=False)
    ours = {"val_accuracy": result.history["val_accuracy"], "seconds": time.perf_counter() - started}

    keras.utils.set_random_seed(0)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    with strategy.scope():
        model = user_cnn()
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=user_loss(), metrics=["accuracy"])
    started = time.perf_counter()
    history = model.fit(train[0], train[1], batch_size=BATCH * REPLICAS, epochs=epochs,
                        steps_per_epoch=steps_per_epoch, validation_data=test, verbose=0)
    theirs = {"val_accuracy": [float(a) for a in history.history["val_accuracy"]],
              "seconds": time.perf_counter() - started}
    return {"epochs": epochs, "replicas": REPLICAS, "batch_size": BATCH, "gpupar.fit": ours, "model.fit": theirs,
            "difference": float(np.abs(ours["val_accuracy"][-1] - theirs["val_accuracy"][-1]))}


def table(report) -> str:
    """The comparison as text: test accuracy per epoch and seconds, for each."""
    lines = [f"{'':<12}" + "".join(f"{'epoch ' + str(e):>10}" for e in range(report["epochs"])) + f"{'seconds':>10}"]
    for name in ("gpupar.fit", "model.fit"):
        row = report[name]
        lines.append(f"{name:<12}" + "".join(f"{a:>10.4f}" for a in row["val_accuracy"]) + f"{row['seconds']:>10.0f}")
    lines.append(f"last epoch's test accuracy differs by {report['difference']:.4f}")
    return "\n".join(lines)


def main() -> int:
    """Runs the comparison, prints the table and writes JSON."""
    report = compare(script.data_dir(FLAGS.data_dir), FLAGS.epochs)
    print(table(report))
    if FLAGS.json:
        script.write_json(FLAGS.json, report)
    return 0


if __name__ == "__main__":
    script.run("benchmarks.versus_fit", define_flags, main)
