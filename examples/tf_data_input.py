"""A tf.data pipeline of your own (files, map, cache, shuffle) feeding your model on every device.

    python examples/tf_data_input.py            # TF1: a queue runner over TFRecord files
    python examples/tf_data_input.py --quick    # a few steps, as the tests run it

The example writes the Fashion-MNIST training images into TFRecord files, reads them back with
a tf.data pipeline that decodes, caches and shuffles (with a fixed seed, so a resumed run sees
the same order), and hands gpupar the unbatched dataset: gpupar batches it by the global batch
and splits each batch over the replicas.
"""

import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf

import gpupar
from gpupar.data.idx import load_idx_dir

quick = "--quick" in sys.argv
# Device settings come before any TensorFlow work, and building a dataset is TensorFlow work.
gpupar.configure_devices(gpupar.Config(virtual_cpus=2))  # two logical CPU devices stand in for two GPUs
data = load_idx_dir("/usr/share/datasets/fashion-mnist")
count = 2048 if quick else len(data.train_labels)
folder = tempfile.mkdtemp(prefix="gpupar-tfrecords-")
files = [f"{folder}/part-{i}.tfrecord" for i in range(4)]
for i, path in enumerate(files):
    with tf.io.TFRecordWriter(path) as writer:
        for image, label in zip(data.train_images[i:count:4], data.train_labels[i:count:4]):
            features = {"image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image.tobytes()])),
                        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)]))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())


def decode(record):
    parsed = tf.io.parse_single_example(record, {"image": tf.io.FixedLenFeature([], tf.string),
                                                 "label": tf.io.FixedLenFeature([], tf.int64)})
    image = tf.reshape(tf.io.decode_raw(parsed["image"], tf.uint8), (28, 28, 1))
    return tf.cast(image, tf.float32) / 255.0, parsed["label"]


dataset = (tf.data.TFRecordDataset(files).map(decode, num_parallel_calls=tf.data.AUTOTUNE).cache()
           .shuffle(4096, seed=0).apply(tf.data.experimental.assert_cardinality(count)))
test = tf.data.Dataset.from_tensor_slices(((data.test_images[..., np.newaxis] / 255.0).astype("float32"),
                                           data.test_labels.astype("int64")))
result = gpupar.fit(
    lambda: keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]),
    dataset, validation_data=test.take(1000 if quick else 10000),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
    strategy="mirrored", virtual_cpus=2, batch_size=256, epochs=1, steps_per_epoch=5 if quick else None, save=False,
)
print(f"tf.data input, {count} examples in {len(files)} files: val_accuracy {result.logs['val_accuracy']:.4f}")
