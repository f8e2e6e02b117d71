"""Classification with Gated Residual and Variable Selection Networks on CSV files read by
tf.data.experimental.make_csv_dataset(num_epochs=1), with per-example weights from a CSV column,
shrunk.

keras-io source: examples/structured_data/classification_with_grn_and_vsn.py at commit
3a8622d94d7685d84435388a20316a1544d0af5c (tf.keras version; `tensorflow.keras` imports are
written `keras`, see Deviations for the two changes Keras 3 needs).

Shrunk: 640 synthetic rows of the census-income table instead of the UCI download (about
200,000 rows), in a pandas DataFrame with the census' column types: the numeric `age`, the
categorical `education` (strings with the census' leading space) and `year` (an integer code,
read back as a string, as in the example), the float `instance_weight` and the `income_level`
strings " - 50000." / " 50000+.". The example's table has 42 columns (7 numeric features, 33
categorical ones); the model makes one GatedResidualNetwork per feature and Keras' fit of the
full table takes about 100 s here (17 s with 7 features; almost all of it tracing), so only these
5 columns are kept (3 features, in the example's CSV_HEADER order). Converted and split 85/15
into train/valid as in the example and written with `to_csv(index=False, header=False)` into
workdir; the test file and the closing `model.evaluate(test_dataset)` are left out (the fit's
validation data already report accuracy). Read back exactly as the example does:
`make_csv_dataset(..., column_names=CSV_HEADER, column_defaults=COLUMN_DEFAULTS,
label_name="income_level", num_epochs=1, header=False, shuffle=...)` + `.map(process)`, which
gives (features dict, float32 target, float32 weight) batches; make_csv_dataset's datasets have
unknown cardinality. batch_size 265 -> 64, num_epochs 20 -> 2, encoding_size 16 -> 8. Same
model (an embedding or a Dense projection per feature, one GRN per feature inside the
VariableSelection, sigmoid output), compile (Adam(0.001), BinaryCrossentropy,
BinaryAccuracy(name="accuracy")), and fit keywords (epochs, validation_data,
callbacks=[EarlyStopping(monitor="val_loss", patience=5, restore_best_weights=True)]). The
weights make the logged losses large (hundreds), as in the example.

Deviations: in encode_inputs, `tf.expand_dims(inputs[feature_name], -1)` on a Keras input is
written `keras.ops.expand_dims(...)`: Keras 3 refuses TensorFlow functions on symbolic
KerasTensors, and the Keras 3 version of the example makes the same change. In `process`,
`return features, target, weight` is written `return dict(features), target, weight`, as the
Keras 3 version of the example does ("Change features from OrderedDict to Dict to match Inputs
as they are Dict."): make_csv_dataset yields an OrderedDict in CSV column order, Keras 3
flattens an OrderedDict in that order but the model's plain input dict in sorted key order, and
feeds the columns to the wrong inputs (with the example's 40 features, even Keras' own fit on
one device fails: "UnimplementedError: Graph execution error: Detected at node
functional_1/Cast_4", a string column cast to a float input; the 3 features kept here happen to
be in sorted order already). The train/valid split uses a seeded generator instead of the
global `np.random.rand`.

Keras' own fit under MirroredStrategy fails here (see README.md): before the first step Keras
reduces the first distributed batch with strategy.reduce("MEAN") to build the model
symbolically, and a batch with string features can't be summed.

Causes exercised: a text (CSV) file pipeline of unknown length, with sample weights as the third
element of each batch, string inputs looked up inside the model, validation on a second CSV
file, EarlyStopping with restore_best_weights.

Entry points: `model_fn()` + `train(fit, workdir)` (one model, one fit) and
`script(strategy, fit, workdir)`.
"""

import math
import os

import numpy as np
import pandas as pd
import keras
from keras import layers

# Not QUICK: Keras' fit on one device takes about 10 s here, almost all of it tracing the GRNs.

# Column names (42 in keras-io, in this order; the ones kept here, see the docstring).
CSV_HEADER = [
    "age",
    "education",
    "instance_weight",
    "year",
    "income_level",
]

# Target feature name.
TARGET_FEATURE_NAME = "income_level"
# Weight column name.
WEIGHT_COLUMN_NAME = "instance_weight"
# Numeric feature names.
NUMERIC_FEATURE_NAMES = [  # 7 in keras-io
    "age",
]
_INTEGER_CODED = {"year": 2}  # categorical columns the census codes as integers: how many codes

learning_rate = 0.001
dropout_rate = 0.15
batch_size = 64  # 265 in keras-io
num_epochs = 2  # 20 in keras-io
encoding_size = 8  # 16 in keras-io


def _census(n, rng):
    """A DataFrame like pd.read_csv(census-income.data.gz, header=None, names=CSV_HEADER)."""
    positive = rng.random(n) < 0.2
    columns = {}
    for name in CSV_HEADER:
        if name == TARGET_FEATURE_NAME:
            columns[name] = np.where(positive, " 50000+.", " - 50000.")
        elif name == WEIGHT_COLUMN_NAME:
            columns[name] = np.round(rng.uniform(200, 4000, size=n), 2)
        elif name in NUMERIC_FEATURE_NAMES:
            columns[name] = rng.integers(0, 90, size=n) + 30 * positive  # richer: larger numbers
        elif name in _INTEGER_CODED:
            columns[name] = rng.integers(0, _INTEGER_CODED[name], size=n)
        else:
            codes = rng.integers(0, 6, size=n)
            if name == "education":
                codes = np.where(positive, rng.integers(4, 6, size=n), codes)  # and more educated
            columns[name] = np.array([f" {name[:6]} value {k}" for k in codes])
    return pd.DataFrame(columns)[CSV_HEADER]


def _metadata(data):
    """The example's metadata, from the loaded data: (CATEGORICAL_FEATURES_WITH_VOCABULARY, FEATURE_NAMES, COLUMN_DEFAULTS)."""
    # Categorical features and their vocabulary lists.
    # Note that we add 'v=' as a prefix to all categorical feature values to make
    # sure that they are treated as strings.
    CATEGORICAL_FEATURES_WITH_VOCABULARY = {
        feature_name: sorted([str(value) for value in list(data[feature_name].unique())])
        for feature_name in CSV_HEADER
        if feature_name
        not in list(NUMERIC_FEATURE_NAMES + [WEIGHT_COLUMN_NAME, TARGET_FEATURE_NAME])
    }
    # All features names.
    FEATURE_NAMES = NUMERIC_FEATURE_NAMES + list(
        CATEGORICAL_FEATURES_WITH_VOCABULARY.keys()
    )
    # Feature default values.
    COLUMN_DEFAULTS = [
        [0.0]
        if feature_name in NUMERIC_FEATURE_NAMES + [TARGET_FEATURE_NAME, WEIGHT_COLUMN_NAME]
        else ["NA"]
        for feature_name in CSV_HEADER
    ]
    return CATEGORICAL_FEATURES_WITH_VOCABULARY, FEATURE_NAMES, COLUMN_DEFAULTS


def _data():
    # pd.read_csv(data_url, header=None, names=CSV_HEADER) in keras-io (the UCI download).
    data = _census(640, np.random.default_rng(0))
    # We convert the target column from string to integer.
    data["income_level"] = data["income_level"].apply(
        lambda x: 0 if x == " - 50000." else 1
    )
    return data


class GatedLinearUnit(layers.Layer):
    def __init__(self, units):
        super(GatedLinearUnit, self).__init__()
        self.linear = layers.Dense(units)
        self.sigmoid = layers.Dense(units, activation="sigmoid")

    def call(self, inputs):
        return self.linear(inputs) * self.sigmoid(inputs)


class GatedResidualNetwork(layers.Layer):
    def __init__(self, units, dropout_rate):
        super(GatedResidualNetwork, self).__init__()
        self.units = units
        self.elu_dense = layers.Dense(units, activation="elu")
        self.linear_dense = layers.Dense(units)
        self.dropout = layers.Dropout(dropout_rate)
        self.gated_linear_unit = GatedLinearUnit(units)
        self.layer_norm = layers.LayerNormalization()
        self.project = layers.Dense(units)

    def call(self, inputs):
        x = self.elu_dense(inputs)
        x = self.linear_dense(x)
        x = self.dropout(x)
        if inputs.shape[-1] != self.units:
            inputs = self.project(inputs)
        x = inputs + self.gated_linear_unit(x)
        x = self.layer_norm(x)
        return x


class VariableSelection(layers.Layer):
    def __init__(self, num_features, units, dropout_rate):
        super(VariableSelection, self).__init__()
        self.grns = list()
        # Create a GRN for each feature independently
        for idx in range(num_features):
            grn = GatedResidualNetwork(units, dropout_rate)
            self.grns.append(grn)
        # Create a GRN for the concatenation of all the features
        self.grn_concat = GatedResidualNetwork(units, dropout_rate)
        self.softmax = layers.Dense(units=num_features, activation="softmax")

    def call(self, inputs):
        import tensorflow as tf

        v = layers.concatenate(inputs)
        v = self.grn_concat(v)
        v = tf.expand_dims(self.softmax(v), axis=-1)

        x = []
        for idx, input in enumerate(inputs):
            x.append(self.grns[idx](input))
        x = tf.stack(x, axis=1)

        outputs = tf.squeeze(tf.matmul(v, x, transpose_a=True), axis=1)
        return outputs


def create_model(encoding_size, metadata):
    import tensorflow as tf

    CATEGORICAL_FEATURES_WITH_VOCABULARY, FEATURE_NAMES, _ = metadata

    def create_model_inputs():
        inputs = {}
        for feature_name in FEATURE_NAMES:
            if feature_name in NUMERIC_FEATURE_NAMES:
                inputs[feature_name] = layers.Input(
                    name=feature_name, shape=(), dtype=tf.float32
                )
            else:
                inputs[feature_name] = layers.Input(
                    name=feature_name, shape=(), dtype=tf.string
                )
        return inputs

    def encode_inputs(inputs, encoding_size):
        encoded_features = []
        for feature_name in inputs:
            if feature_name in CATEGORICAL_FEATURES_WITH_VOCABULARY:
                vocabulary = CATEGORICAL_FEATURES_WITH_VOCABULARY[feature_name]
                # Create a lookup to convert a string values to an integer indices.
                # Since we are not using a mask token nor expecting any out of vocabulary
                # (oov) token, we set mask_token to None and  num_oov_indices to 0.
                index = layers.StringLookup(
                    vocabulary=vocabulary, mask_token=None, num_oov_indices=0
                )
                # Convert the string input values into integer indices.
                value_index = index(inputs[feature_name])
                # Create an embedding layer with the specified dimensions
                embedding_ecoder = layers.Embedding(
                    input_dim=len(vocabulary), output_dim=encoding_size
                )
                # Convert the index values to embedding representations.
                encoded_feature = embedding_ecoder(value_index)
            else:
                # Project the numeric feature to encoding_size using linear transformation.
                # tf.expand_dims in keras-io; Keras 3 needs keras.ops on a KerasTensor.
                encoded_feature = keras.ops.expand_dims(inputs[feature_name], -1)
                encoded_feature = layers.Dense(units=encoding_size)(encoded_feature)
            encoded_features.append(encoded_feature)
        return encoded_features

    inputs = create_model_inputs()
    feature_list = encode_inputs(inputs, encoding_size)
    num_features = len(feature_list)

    features = VariableSelection(num_features, encoding_size, dropout_rate)(
        feature_list
    )

    outputs = layers.Dense(units=1, activation="sigmoid")(features)
    model = keras.Model(inputs=inputs, outputs=outputs)
    return model


def model_fn():
    model = create_model(encoding_size, _metadata(_data()))
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=learning_rate),
        loss=keras.losses.BinaryCrossentropy(),
        metrics=[keras.metrics.BinaryAccuracy(name="accuracy")],
    )
    return model


def _datasets(workdir, data):
    """Split, write the CSV files, read them back with make_csv_dataset: (train_dataset, valid_dataset)."""
    import tensorflow as tf

    CATEGORICAL_FEATURES_WITH_VOCABULARY, _, COLUMN_DEFAULTS = _metadata(data)

    # Then, We split the dataset into train and validation sets.
    random_selection = np.random.default_rng(1).random(len(data.index)) <= 0.85  # np.random.rand in keras-io
    train_data = data[random_selection]
    valid_data = data[~random_selection]

    # Finally we store the train and test data splits locally to CSV files.
    train_data_file = os.path.join(workdir, "train_data.csv")  # "train_data.csv" in keras-io
    valid_data_file = os.path.join(workdir, "valid_data.csv")
    train_data.to_csv(train_data_file, index=False, header=False)
    valid_data.to_csv(valid_data_file, index=False, header=False)

    def process(features, target):
        for feature_name in features:
            if feature_name in CATEGORICAL_FEATURES_WITH_VOCABULARY:
                # Cast categorical feature values to string.
                features[feature_name] = tf.cast(features[feature_name], tf.dtypes.string)
        # Get the instance weight.
        weight = features.pop(WEIGHT_COLUMN_NAME)
        # `return features, target, weight` in keras-io; Keras 3 needs a dict (see the docstring).
        return dict(features), target, weight

    def get_dataset_from_csv(csv_file_path, shuffle=False, batch_size=128):
        dataset = tf.data.experimental.make_csv_dataset(
            csv_file_path,
            batch_size=batch_size,
            column_names=CSV_HEADER,
            column_defaults=COLUMN_DEFAULTS,
            label_name=TARGET_FEATURE_NAME,
            num_epochs=1,
            header=False,
            shuffle=shuffle,
        ).map(process)

        return dataset

    train_dataset = get_dataset_from_csv(
        train_data_file, shuffle=True, batch_size=batch_size
    )
    valid_dataset = get_dataset_from_csv(valid_data_file, batch_size=batch_size)
    return train_dataset, valid_dataset


def train(fit, workdir):
    train_dataset, valid_dataset = _datasets(workdir, _data())
    # Create an early stopping callback.
    early_stopping = keras.callbacks.EarlyStopping(
        monitor="val_loss", patience=5, restore_best_weights=True
    )
    return fit(
        train_dataset,
        epochs=num_epochs,
        validation_data=valid_dataset,
        callbacks=[early_stopping],
    )


def script(strategy, fit, workdir):
    """The example's program; the model is made and compiled in strategy.scope(), model.fit(...) is fit(model, ...)."""
    data = _data()
    with strategy.scope():
        model = create_model(encoding_size, _metadata(data))
        model.compile(
            optimizer=keras.optimizers.Adam(learning_rate=learning_rate),
            loss=keras.losses.BinaryCrossentropy(),
            metrics=[keras.metrics.BinaryAccuracy(name="accuracy")],
        )

    # Create an early stopping callback.
    early_stopping = keras.callbacks.EarlyStopping(
        monitor="val_loss", patience=5, restore_best_weights=True
    )

    train_dataset, valid_dataset = _datasets(workdir, data)
    return fit(
        model,
        train_dataset,
        epochs=num_epochs,
        validation_data=valid_dataset,
        callbacks=[early_stopping],
    )
