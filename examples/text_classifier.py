"""A text classifier on raw strings, ported from model.fit by the rule: build and compile in model_fn.

    python examples/text_classifier.py            # two replicas (virtual CPUs here, GPUs elsewhere)
    python examples/text_classifier.py --quick    # a few steps, as the tests run it

The model takes raw strings: a TextVectorization layer, adapted on the training texts, turns
them into token ids inside the model, so the saved model classifies strings too. Keras' own
model.fit refuses these NumPy arrays of strings ("Invalid dtype: object", on one device or
several); gpupar.fit trains on them, on both replicas. The reviews are made up from a few
dozen words (no download here): each says what its label says, in noise.

The Keras script, and what changed:

    model = make_model()                              def model_fn():
    model.compile(optimizer="adam", ...)                  model = make_model()
    model.fit(texts, labels, batch_size=64,               model.compile(optimizer="adam", ...)
              epochs=3, validation_split=0.2)             return model
                                                      gpupar.fit(model_fn, texts, labels, batch_size=64, epochs=3,
                                                                 validation_split=0.2, strategy="mirrored")
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import gpupar

quick = "--quick" in sys.argv
gpupar.configure_devices(virtual_cpus=2)  # first: adapt() below starts TensorFlow

POSITIVE = "good great fine lovely superb wonderful enjoyable brilliant".split()
NEGATIVE = "bad awful poor dull boring terrible weak dreadful".split()
FILLER = "the a film story actor plot scene it was is and but very quite".split()


def reviews(count, seed):
    """Made-up reviews: ten words each, three of them saying the label, the rest filler."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, count)
    texts = [" ".join(rng.permutation(list(rng.choice(POSITIVE if label else NEGATIVE, 3)) +
                                      list(rng.choice(FILLER, 7)))) for label in labels]
    return np.array(texts, dtype=object), labels.astype("float32")


texts, labels = reviews(512 if quick else 8192, seed=0)
vectorize = keras.layers.TextVectorization(max_tokens=64, output_sequence_length=10)
vectorize.adapt(texts)


def model_fn():
    model = keras.Sequential([keras.Input((1,), dtype="string"), vectorize, keras.layers.Embedding(64, 16),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy")])
    return model


result = gpupar.fit(model_fn, texts[:, None], labels, batch_size=64, epochs=1 if quick else 3, validation_split=0.2,
                    strategy="mirrored", virtual_cpus=2, save=False)
score = float(result.model.predict(tf.constant([["a good film"], ["a dull film"]]), verbose=0)[0, 0])
print(f"{result.replicas} replicas: val_accuracy {result.history['val_accuracy'][-1]:.4f}; "
      f"'a good film' scores {score:.2f} (logit)")
