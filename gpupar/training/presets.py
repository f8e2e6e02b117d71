"""The MNIST presets as Tasks: the ConvNet or the stacked LSTM on (Fashion-)MNIST, as `gpupar.fit_mnist` trains them."""

import keras

from gpupar.data import augment, mnist
from gpupar.data.sources import ARRAYS, Source
from gpupar.models.presets import build_model, model_signature, stage_ends
from gpupar.training.task import Task

# The preset's objective: the models give logits; the L2 penalty is in model.losses.
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
METRICS = ("accuracy",)


def mnist_task(config, optimizer=None, callbacks=()) -> Task:
    """The Task of config.model on config.dataset (TFDS, or the IDX files of config.data_dir)."""

    def sources():
        splits = mnist.load_splits(config.dataset, config.data_dir)
        where = config.data_dir or f"TFDS {config.dataset}"
        host = config.augment and config.augment_on == "host"
        train = Source(ARRAYS, f"{len(splits.train_labels)} training images from {where}",
                       (splits.train_images, splits.train_labels), len(splits.train_labels),
                       transform=None if host else mnist.normalise,
                       host_transform=mnist.host_augmentation(config.seed) if host else None)
        test = Source(ARRAYS, f"{len(splits.test_labels)} test images", (splits.test_images, splits.test_labels),
                      len(splits.test_labels), transform=mnist.normalise)
        return train, test

    def device_transform(images, step):
        return augment.random_affine(images, augment.device_seed(config.seed, step))

    on_device = config.augment and config.augment_on == "device"
    return Task(
        build_model=lambda: build_model(config), sources=sources,
        loss=LOSS, metrics=METRICS, optimizer=optimizer, callbacks=tuple(callbacks), signature=model_signature(config),
        device_transform=device_transform if on_device else None, per_worker_input=True, stage_ends=stage_ends(config),
    )
