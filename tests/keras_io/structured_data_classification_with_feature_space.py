"""Structured data classification with FeatureSpace (heart disease CSV), shrunk.

keras-io source: examples/structured_data/structured_data_classification_with_feature_space.py
at commit f54746f7633a6e4eedb38f273ab4c71944f01df6 (Keras 3 version).

Shrunk: 300 synthetic patients (the real CSV has 303) as a dict of NumPy arrays with the
DataFrame's column dtypes (int64 columns, float64 "oldpeak", str "thal") instead of a pandas
DataFrame (pandas is not installed); the 20% validation sample is drawn with a seeded generator
instead of DataFrame.sample(random_state=1337). The pipeline is the example's:
tf.data.Dataset.from_tensor_slices((dict, labels)).shuffle(len).batch(32), the customised
FeatureSpace (num_oov_indices=0, 30 age bins, crosses 64/16) adapted on the label-free training
dataset, then applied in the tf.data pipeline. Dense 32 -> 8; epochs 20 -> 2. The training model
takes the encoded feature vector (FeatureSpace.get_encoded_features()) exactly as in the example.

The FeatureSpace is built and adapted in a cached helper on first use (never at import); train()
builds it before calling fit so that it is made outside any distribution scope.
"""

import functools

import numpy as np
import keras
from keras.utils import FeatureSpace

QUICK = True


@functools.cache
def _dataframe_split():
    """(train, val): dicts of column -> NumPy array, "target" included, as the CSV would give them."""
    rng = np.random.default_rng(0)
    n = 300
    target = rng.integers(0, 2, size=n)
    df = {
        "age": rng.integers(29, 78, size=n) + 3 * target,
        "sex": rng.integers(0, 2, size=n),
        "cp": np.where(target == 1, rng.integers(2, 5, size=n), rng.integers(0, 3, size=n)),
        "trestbps": rng.integers(94, 200, size=n),
        "chol": rng.integers(126, 400, size=n),
        "fbs": rng.integers(0, 2, size=n),
        "restecg": rng.integers(0, 3, size=n),
        "thalach": rng.integers(71, 202, size=n) - 15 * target,
        "exang": rng.integers(0, 2, size=n),
        "oldpeak": np.round(rng.uniform(0, 6.2, size=n) + target, 1),
        "slope": rng.integers(1, 4, size=n),
        "ca": rng.integers(0, 4, size=n),
        "thal": rng.choice(np.array(["normal", "fixed", "reversible"], dtype=object), size=n),
        "target": target,
    }
    df = {k: (v.astype("int64") if v.dtype.kind == "i" else v) for k, v in df.items()}
    val_index = rng.choice(n, size=int(0.2 * n), replace=False)
    is_val = np.zeros(n, dtype=bool)
    is_val[val_index] = True
    return ({k: v[~is_val] for k, v in df.items()}, {k: v[is_val] for k, v in df.items()})


def dataframe_to_dataset(dataframe):
    import tensorflow as tf

    dataframe = dict(dataframe)
    labels = dataframe.pop("target")
    ds = tf.data.Dataset.from_tensor_slices((dict(dataframe), labels))
    ds = ds.shuffle(buffer_size=len(labels))
    return ds


@functools.cache
def _feature_space():
    # FeatureSpace configuration from keras-io @ f54746f (the customised one).
    feature_space = FeatureSpace(
        features={
            # Categorical features encoded as integers
            "sex": FeatureSpace.integer_categorical(num_oov_indices=0),
            "cp": FeatureSpace.integer_categorical(num_oov_indices=0),
            "fbs": FeatureSpace.integer_categorical(num_oov_indices=0),
            "restecg": FeatureSpace.integer_categorical(num_oov_indices=0),
            "exang": FeatureSpace.integer_categorical(num_oov_indices=0),
            "ca": FeatureSpace.integer_categorical(num_oov_indices=0),
            # Categorical feature encoded as string
            "thal": FeatureSpace.string_categorical(num_oov_indices=0),
            # Numerical features to discretize
            "age": FeatureSpace.float_discretized(num_bins=30),
            # Numerical features to normalize
            "trestbps": FeatureSpace.float_normalized(),
            "chol": FeatureSpace.float_normalized(),
            "thalach": FeatureSpace.float_normalized(),
            "oldpeak": FeatureSpace.float_normalized(),
            "slope": FeatureSpace.float_normalized(),
        },
        # Specify feature cross with a custom crossing dim.
        crosses=[
            FeatureSpace.cross(feature_names=("sex", "age"), crossing_dim=64),
            FeatureSpace.cross(feature_names=("thal", "ca"), crossing_dim=16),
        ],
        output_mode="concat",
    )
    train_ds = dataframe_to_dataset(_dataframe_split()[0]).batch(32)
    train_ds_with_no_labels = train_ds.map(lambda x, _: x)
    feature_space.adapt(train_ds_with_no_labels)
    return feature_space


def model_fn():
    feature_space = _feature_space()
    encoded_features = feature_space.get_encoded_features()
    x = keras.layers.Dense(8, activation="relu")(encoded_features)  # 32 in keras-io
    x = keras.layers.Dropout(0.5)(x)
    predictions = keras.layers.Dense(1, activation="sigmoid")(x)
    training_model = keras.Model(inputs=encoded_features, outputs=predictions)
    training_model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return training_model


def train(fit, workdir):
    import tensorflow as tf

    feature_space = _feature_space()
    train_dataframe, val_dataframe = _dataframe_split()
    train_ds = dataframe_to_dataset(train_dataframe).batch(32)
    val_ds = dataframe_to_dataset(val_dataframe).batch(32)

    preprocessed_train_ds = train_ds.map(
        lambda x, y: (feature_space(x), y), num_parallel_calls=tf.data.AUTOTUNE
    )
    preprocessed_train_ds = preprocessed_train_ds.prefetch(tf.data.AUTOTUNE)
    preprocessed_val_ds = val_ds.map(
        lambda x, y: (feature_space(x), y), num_parallel_calls=tf.data.AUTOTUNE
    )
    preprocessed_val_ds = preprocessed_val_ds.prefetch(tf.data.AUTOTUNE)

    return fit(
        preprocessed_train_ds,
        epochs=2,  # 20 in keras-io
        validation_data=preprocessed_val_ds,
        verbose=2,
    )
