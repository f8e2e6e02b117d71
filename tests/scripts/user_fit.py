"""A user's own training script, as `gpupar launch -- python tests/scripts/user_fit.py ...` runs it.

    python user_fit.py MODEL_DIR STRATEGY EPOCHS [guide]

A model and data of its own (not gpupar's), through gpupar.fit, with resume=True so that a task
the launcher restarts continues from the newest checkpoint. It prints its final weights' sum.
With `guide` it is written as Keras' multi-GPU guide writes it, with the two renames: the
strategy first (gpupar.strategy), the model built and compiled in its scope, gpupar.fit(model, ...).
"""

import sys

import keras
import numpy as np

import gpupar

model_dir, strategy, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
guide = sys.argv[4:] == ["guide"]
if guide:
    strategy = gpupar.strategy(strategy)  # was: tf.distribute.MultiWorkerMirroredStrategy()
rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 20)).astype("float32")
y = (x[:, :10].sum(axis=1) > 0).astype("int64")


def model_fn():
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(2)])


options = dict(per_replica_batch_size=16, epochs=epochs, model_dir=model_dir, resume=True, checkpoint_every_steps=4)
if guide:
    with strategy.scope():
        model = model_fn()
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    result = gpupar.fit(model, x, y, validation_data=(x[:200], y[:200]), **options)  # was: model.fit(...)
else:
    result = gpupar.fit(
        model_fn, x, y, validation_data=(x[:200], y[:200]), metrics=["accuracy"],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=lambda: keras.optimizers.SGD(0.1), strategy=strategy, **options)
weights = sum(float(np.sum(w)) for w in result.model.get_weights())
print(f"user_fit done: {result.replicas} replicas, val_accuracy {result.logs['val_accuracy']:.4f}, "
      f"weights {weights:.6f}")
