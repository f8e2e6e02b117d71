"""The MNIST presets: the ConvNet or the stacked LSTM on (Fashion-)MNIST, as `gpupar.fit_mnist` and the `gpupar` command train them.

The preset's own options (gpupar.presets.mnist_options.MnistOptions) sit beside the Config: the
data set and its folder, the model and its sizes, augmentation, and a stop at a test accuracy.
`mnist_run` turns them into the Config and the Task of a run; everything after that is
gpupar.fit's path. The preset's preprocessing is its own, where Keras puts it: the images are
normalised in its dataset, augmented in its dataset (on the host) or by the model's first layer
(on the device).
"""

import functools

import keras
import numpy as np
import tensorflow as tf

from gpupar.config import Config
from gpupar.data import array_pipeline, mnist_images
from gpupar.data.adapters.arrays import ArrayAdapter
from gpupar.data.adapters.adapter import DataAdapter
from gpupar.errors import GpuparError
from gpupar.models import convnet, lstm
from gpupar.models.layers import RandomAffine
from gpupar.presets.mnist_options import MnistOptions
from gpupar.runtime.cluster import detect_cluster
from gpupar.training import modes
from gpupar.training.task import Task

# The preset's objective: the models give logits; the L2 penalty is in model.losses.
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
METRICS = ("accuracy",)


def stage_ends(options: MnistOptions) -> tuple:
    """Where the model's pipeline stages end (runtime.stages.stage_of_layers), for a mode that takes stages."""
    return lstm.stage_ends(options.lstm_layers) if options.model == "lstm" else convnet.STAGE_ENDS


def build_model(options: MnistOptions, seed: int):
    """The model `options.model` names, led by the augmentation layer where it augments on the device.

    Its layers compute in the dtype policy the run sets around the build (its precision).
    """
    if options.model == "lstm":
        model = lstm.build_lstm(options.lstm_layers, options.lstm_units, seed=seed)
    else:
        model = convnet.build_convnet(options.dropout, options.sync_batch_norm, seed=seed)
    if options.augment and options.augment_on == "device":
        return keras.Sequential([keras.Input((28, 28, 1)), RandomAffine(seed, dtype="float32"), *model.layers],
                                name=model.name)
    return model


class MnistArrays(ArrayAdapter):
    """A split of the MNIST-format data in memory, normalised in its pipeline, and for training augmented on the host
    when the options say so.

    Loaded once the strategy exists (TFDS runs TensorFlow); both splits share one load.
    """

    per_worker = True  # each parameter-server worker reads its own shard of the seeded batch order

    def __init__(self, load, split: str, where: str, options: MnistOptions):
        DataAdapter.__init__(self, None, f"the {split} split")  # the arrays come with prepare()
        self.load, self.split, self.where = load, split, where
        self.form = "the MNIST preset's arrays"
        self.augmented_on = options.augment_on if split == "train" and options.augment else None

    def prepare(self, input_options, seed: int):
        DataAdapter.prepare(self, input_options, seed)
        splits = self.load()
        images, labels = ((splits.train_images, splits.train_labels) if self.split == "train"
                          else (splits.test_images, splits.test_labels))
        self.arrays, self.num_examples = (images, labels), len(labels)
        self.description = (f"{self.num_examples} training images from {self.where}" if self.split == "train"
                            else f"{self.num_examples} test images")
        if self.augmented_on:
            self.description += f", randomly shifted, rotated and zoomed on the {self.augmented_on}"

    def sample(self, count: int = 4):
        return tuple(np.asarray(t) for t in mnist_images.normalise(*(a[:count] for a in self.arrays)))

    def batches(self, global_batch: int, first_step: int = 0, limit=None):
        if self.augmented_on != "host":
            return super().batches(global_batch, first_step, limit).map(mnist_images.normalise)
        options = self.options
        dataset = array_pipeline.train_dataset(
            self.arrays, global_batch, self.seed, start_step=first_step,
            example_map=mnist_images.host_augmentation(self.seed), num_parallel_calls=options.num_parallel_calls,
            deterministic=options.deterministic, threads=options.data_threads, shuffle=options.shuffle)
        return dataset if limit is None else dataset.take(limit)

    def one_pass(self, global_batch: int):
        dataset, steps = super().one_pass(global_batch)
        return dataset.map(mnist_images.normalise), steps

    def worker_batches(self, context, global_batch: int, first_step: int, limit, num_workers: int):
        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        return self.batches(global_batch, first_step, limit).shard(num_workers, worker)

    def input_bound_hints(self):
        return ["augmentation runs on the host, one image at a time: use --augment_on=device"] if (
            self.augmented_on == "host") else []


def refuse_for_mode(options: MnistOptions, mode) -> None:
    """The preset's options that `mode` cannot run, refused before TensorFlow starts (from its declared capabilities)."""
    if mode.replicas_step_together:
        return
    if options.augment:
        raise GpuparError(f"augment is not available with strategy={mode.name} (its replicas do not step together); "
                          "drop --augment, or use a data-parallel strategy")
    if options.sync_batch_norm:
        raise GpuparError(f"sync_batch_norm synchronises replicas that step together; strategy={mode.name} "
                          f"{mode.batch_norm}: drop sync_batch_norm")


def mnist_run(config: Config, options: MnistOptions, optimizer=None, callbacks=()):
    """(the Config, the Task, the checked mode) of the preset: options.model on options.dataset, as `config` says.

    The preset's own split of the model (stage_ends) is the Config's stages where the mode takes
    stages and the Config gives none; stop_at_accuracy is a stop at val_accuracy.

    Raises:
      GpuparError: an option the run's mode cannot run, before TensorFlow starts.
    """
    cluster = detect_cluster(slurm_ps=config.distribution.slurm_ps)
    mode = modes.select(config.distribution, cluster)  # its declared capabilities, before the Config is final
    refuse_for_mode(options, mode)
    changes = {}
    if "stages" in mode.options and config.distribution.stages is None:
        changes["stages"] = stage_ends(options)
    if options.stop_at_accuracy is not None:
        changes["stop_at"] = {**(config.loop.stop_at or {}), "val_accuracy": options.stop_at_accuracy}
    config = config.replace(**changes) if changes else config
    load = functools.lru_cache(maxsize=None)(lambda: mnist_images.load_splits(options.dataset, options.data_dir))
    where = options.data_dir or f"TFDS {options.dataset}"
    seed = config.seed
    task = Task(build_model=lambda: build_model(options, seed),
                train=MnistArrays(load, "train", where, options), validation=MnistArrays(load, "test", where, options),
                loss=LOSS, metrics=METRICS, optimizer=optimizer, callbacks=tuple(callbacks),
                signature=options.signature())
    return config, task, modes.checked(config, cluster)
