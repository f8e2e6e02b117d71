"""The "endpoint layer" pattern: a layer that takes the targets and sample weights as model
inputs, computes the loss with `self.add_loss()` and updates its own metric in `call()`; the
models are compiled with an optimizer only (no loss) and fit on a dict of inputs with no y,
shrunk.

keras-io source: examples/keras_recipes/endpoint_layer_pattern.py, the Keras 3 version ("Last
modified: 2023/11/22": `import keras`, `super().__init__`, the accuracy is a
`keras.metrics.BinaryAccuracy` attribute updated with `update_state` in `call()`, since Keras 3
has no `add_metric`). The stored snapshots of keras-team/keras-io's .py file (latest
8320a6c0a63cd6debe960689c182cee491193fa9) and of its rendered md are the older tf.keras version
(`self.add_metric(...)`, which Keras 3 removed); this text was read from the search index's copy
of the Keras 3 file (index file id 1917117317, which names no repository or commit; the same
code is in keras.io's rendered page). See README.md.

Shrunk: the example's data are already synthetic (`np.random.random` inputs (1000, 764), targets
(1000, 1) in [0, 1) and sample weights (1000, 1)); here 256 rows from a seeded generator, float64
as np.random.random gives them. Same layers, compile (Adam(1e-3), no loss), fit calls
(`model.fit(data, epochs=2)`, Keras' default batch size 32) and the inference-only model in
between (set_weights + predict on 1000 -> 256 new random rows). The example evaluates nothing;
the histories hold `loss` (and what Keras logs of the layer's metric).

Causes exercised: a model whose whole loss comes from `self.add_loss()` in a layer (compile with
no loss, fit with no y; the targets and sample weights are model inputs); a metric updated
inside `call()`; a functional and a subclassed model, each fit once, and a predict between.

With Keras' own fit on two replicas the added loss is divided by the replica count twice (once
by the Keras Loss called in a strategy, once by Keras' add_loss aggregation): the logged loss and
its gradient are halved (see README.md).

Entry point: `script(strategy, fit, workdir)` only: the program builds and fits two models (and
an inference model), which model_fn() + a single train(fit, workdir) can't express. `script`
returns the last fit's history (the subclassed LogReg's).
"""

import numpy as np
import keras

QUICK = True

num_rows = 256  # 1000 in keras-io


class LogisticEndpoint(keras.layers.Layer):
    # From keras-io (Keras 3 version), unchanged.
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        self.accuracy_metric = keras.metrics.BinaryAccuracy(name="accuracy")

    def call(self, logits, targets=None, sample_weight=None):
        import tensorflow as tf

        if targets is not None:
            # Compute the training-time loss value and add it
            # to the layer using `self.add_loss()`.
            loss = self.loss_fn(targets, logits, sample_weight)
            self.add_loss(loss)

            # Log the accuracy as a metric (we could log arbitrary metrics,
            # including different metrics for training and inference.)
            self.accuracy_metric.update_state(targets, logits, sample_weight)

        # Return the inference-time prediction tensor (for `.predict()`).
        return tf.nn.softmax(logits)


class LogReg(keras.Model):
    # From keras-io (Keras 3 version), unchanged.
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.logistic_endpoint = LogisticEndpoint()

    def call(self, inputs):
        # Note that all inputs should be in the first argument
        # since we want to be able to call `model.fit(inputs)`.
        logits = self.dense(inputs["inputs"])
        preds = self.logistic_endpoint(
            logits=logits,
            targets=inputs["targets"],
            sample_weight=inputs["sample_weight"],
        )
        return preds


def script(strategy, fit, workdir):
    """The example's program; what makes variables is in strategy.scope(), model.fit(...) is fit(model, ...)."""
    rng = np.random.default_rng(0)  # np.random.random(...) in keras-io

    # Usage of endpoint layers in the Functional API
    with strategy.scope():
        inputs = keras.Input((764,), name="inputs")
        logits = keras.layers.Dense(1)(inputs)
        targets = keras.Input((1,), name="targets")
        sample_weight = keras.Input((1,), name="sample_weight")
        preds = LogisticEndpoint()(logits, targets, sample_weight)
        model = keras.Model([inputs, targets, sample_weight], preds)

    data = {
        "inputs": rng.random((num_rows, 764)),
        "targets": rng.random((num_rows, 1)),
        "sample_weight": rng.random((num_rows, 1)),
    }

    with strategy.scope():
        model.compile(keras.optimizers.Adam(1e-3))
    fit(model, data, epochs=2)

    # Exporting an inference-only model
    with strategy.scope():
        inputs = keras.Input((764,), name="inputs")
        logits = keras.layers.Dense(1)(inputs)
        preds = LogisticEndpoint()(logits, targets=None, sample_weight=None)
        inference_model = keras.Model(inputs, preds)

    inference_model.set_weights(model.get_weights())

    preds = inference_model.predict(rng.random((num_rows, 764)))

    # Usage of loss endpoint layers in subclassed models
    with strategy.scope():
        model = LogReg()
    data = {
        "inputs": rng.random((num_rows, 764)),
        "targets": rng.random((num_rows, 1)),
        "sample_weight": rng.random((num_rows, 1)),
    }

    with strategy.scope():
        model.compile(keras.optimizers.Adam(1e-3))
    return fit(model, data, epochs=2)
