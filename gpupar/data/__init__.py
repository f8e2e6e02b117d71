"""The data: MNIST-format files and TFDS (`mnist`, `idx`), the tf.data pipelines, and augmentation."""
