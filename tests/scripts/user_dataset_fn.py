"""A user's own script with an embedding model and a dataset_fn, as `gpupar launch -- python ...` runs it.

    python user_dataset_fn.py MODEL_DIR EPOCHS [arrays | guide]

The same script trains on one machine, on synchronous workers, or with parameter servers
(strategy auto picks from TF_CONFIG). With `guide` it is written as Keras' multi-GPU guide
writes a script, with the two renames: gpupar.strategy() first thing (it joins the cluster; on a
parameter server's ps and worker tasks it serves), the model built and compiled under its scope,
and gpupar.fit(model, ...). Each example is 4 token ids; its label says whether at
least two of them are below 32. The embedding table, 8192 x 16 floats (512 KiB), is large enough
to be split over two ps tasks. It resumes from the newest checkpoint (resume=True) and prints
its final logs and weights' sum. With `arrays` it gives its training data as arrays instead,
which parameter servers refuse.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import gpupar

model_dir, epochs = sys.argv[1], int(sys.argv[2])
as_arrays, as_guide = sys.argv[3:] == ["arrays"], sys.argv[3:] == ["guide"]
VOCABULARY, BATCH = 8192, 32
strategy = gpupar.strategy() if as_guide else None  # was: tf.distribute.MultiWorkerMirroredStrategy() (or PS)


def examples(seed, count):
    ids = np.random.default_rng(seed).integers(0, 64, size=(count, 4)).astype("int32")
    return ids, ((ids < 32).sum(axis=1) >= 2).astype("int32")


def dataset_fn(input_context):
    ids, labels = examples(input_context.input_pipeline_id, 1024)
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).shuffle(1024, seed=input_context.input_pipeline_id)
    return dataset.batch(input_context.get_per_replica_batch_size(BATCH * input_context.num_replicas_in_sync))


def model_fn():
    return keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(VOCABULARY, 16, name="embed"),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(2)])


data = dict(zip("xy", examples(0, 1024)), per_replica_batch_size=BATCH) if as_arrays else dict(x=dataset_fn)
if as_guide:
    with strategy.scope():
        model = model_fn()
        model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    result = gpupar.fit(model, **data, validation_data=examples(99, 256), epochs=epochs, model_dir=model_dir,
                        resume=True)  # was: model.fit(...)
else:
    result = gpupar.fit(
        model_fn, **data, validation_data=examples(99, 256), metrics=["accuracy"],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=lambda: keras.optimizers.Adam(0.01), epochs=epochs, model_dir=model_dir, resume=True,
    )
weights = sum(float(np.sum(w)) for w in result.model.get_weights())
print(f"user_dataset_fn done: {result.strategy_description.split(';')[0]}, val_accuracy "
      f"{result.logs.get('val_accuracy', float('nan')):.4f}, weights {weights:.6f}")
