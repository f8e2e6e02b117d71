"""The MNIST presets: the ConvNet or the stacked LSTM on (Fashion-)MNIST, as `gpupar.fit_mnist` and the `gpupar` command train them.

The preset's own options (gpupar.presets.mnist_options.MnistOptions) sit beside the Config: the
data set and its folder, the model and its sizes, augmentation, and a stop at a test accuracy.
`mnist_run` turns them into the Config and the Task of a run; everything after that is
gpupar.fit's path.
"""

import functools

import keras

from gpupar.config import Config
from gpupar.data import augment, mnist_images
from gpupar.data.adapters.arrays import ArrayAdapter
from gpupar.data.adapters.adapter import DataAdapter
from gpupar.errors import GpuparError
from gpupar.models import convnet, lstm
from gpupar.presets.mnist_options import MnistOptions
from gpupar.runtime.cluster import detect_cluster
from gpupar.training import modes
from gpupar.training.task import Task

# The preset's objective: the models give logits; the L2 penalty is in model.losses.
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
METRICS = ("accuracy",)


def stage_ends(options: MnistOptions) -> tuple:
    """Where the model's pipeline stages end (runtime.stages.stage_of_layers), for strategy=model_parallel."""
    return lstm.stage_ends(options.lstm_layers) if options.model == "lstm" else convnet.STAGE_ENDS


def build_model(options: MnistOptions, precision: str, seed: int):
    """The model `options.model` names, in the run's precision."""
    dtype = None if precision == "float32" else precision
    if options.model == "lstm":
        return lstm.build_lstm(options.lstm_layers, options.lstm_units, seed=seed, dtype=dtype)
    return convnet.build_convnet(options.dropout, options.sync_batch_norm, seed=seed, dtype=dtype)


class MnistArrays(ArrayAdapter):
    """A split of the MNIST-format data in memory, normalised, and for training augmented as the options say.

    Loaded once the strategy exists (TFDS runs TensorFlow); both splits share one load.
    """

    per_worker = True  # each parameter-server worker reads its own shard of the seeded batch order

    def __init__(self, load, split: str, where: str, options: MnistOptions):
        DataAdapter.__init__(self, None, f"the {split} split")  # the arrays come with prepare()
        self.load, self.split, self.where = load, split, where
        self.form = "the MNIST preset's arrays"
        self.augmented_on = options.augment_on if split == "train" and options.augment else None
        self.host = self.augmented_on == "host"
        self.transform = None if self.host else mnist_images.normalise

    def prepare(self, input_options, seed: int):
        DataAdapter.prepare(self, input_options, seed)
        splits = self.load()
        images, labels = ((splits.train_images, splits.train_labels) if self.split == "train"
                          else (splits.test_images, splits.test_labels))
        self.arrays, self.num_examples = (images, labels), len(labels)
        self.description = (f"{self.num_examples} training images from {self.where}" if self.split == "train"
                            else f"{self.num_examples} test images")
        if self.host:
            self.host_transform = mnist_images.host_augmentation(seed)
        if self.augmented_on:
            self.description += f", randomly shifted, rotated and zoomed on the {self.augmented_on}"

    @property
    def device_transform(self):
        if self.augmented_on != "device":
            return None
        seed = self.seed
        return lambda images, step: augment.random_affine(images, augment.device_seed(seed, step))

    def worker_batches(self, context, global_batch: int, first_step: int, limit, num_workers: int):
        import tensorflow as tf

        worker = tf.distribute.coordinator.experimental_get_current_worker_index()
        return self.batches(global_batch, first_step, limit).shard(num_workers, worker)

    def input_bound_hints(self):
        return ["augmentation runs on the host, one image at a time: use --augment_on=device"] if self.host else []


def refuse_for_mode(options: MnistOptions, mode) -> None:
    """The preset's options that `mode` cannot run, refused before TensorFlow starts."""
    if mode.name == "synchronous":
        return
    name = mode.name
    if options.augment:
        raise GpuparError(f"augment is not available with strategy={name} (its input pipeline has no augmentation); "
                          "drop --augment, or use a data-parallel strategy")
    if options.sync_batch_norm:
        raise GpuparError("sync_batch_norm synchronises tf.distribute replicas; strategy=model_parallel normalises each "
                          "micro-batch on its own (as GPipe does); drop sync_batch_norm" if mode.name == "model_parallel"
                          else "sync_batch_norm needs replicas that step together; parameter_server updates "
                          "asynchronously")
    if mode.name == "parameter_server" and options.model != "convnet":
        raise GpuparError(f"model={options.model} is not available with strategy=parameter_server, which trains the "
                          "ConvNet; use model=convnet")


def mnist_run(config: Config, options: MnistOptions, optimizer=None, callbacks=()):
    """(the Config, the Task) of the preset: options.model on options.dataset, as `config` says.

    The preset's own split of the model (stage_ends) is the Config's stages where it gives none
    for strategy=model_parallel; stop_at_accuracy is a stop at val_accuracy.

    Raises:
      GpuparError: an option the run's mode cannot run, before TensorFlow starts.
    """
    refuse_for_mode(options, modes.select(config.distribution, detect_cluster(slurm_ps=config.distribution.slurm_ps)))
    changes = {}
    if config.distribution.strategy == modes.MODEL_PARALLEL and config.distribution.stages is None:
        changes["stages"] = stage_ends(options)
    if options.stop_at_accuracy is not None:
        changes["stop_at"] = {**(config.loop.stop_at or {}), "val_accuracy": options.stop_at_accuracy}
    config = config.replace(**changes) if changes else config
    load = functools.lru_cache(maxsize=None)(lambda: mnist_images.load_splits(options.dataset, options.data_dir))
    where = options.data_dir or f"TFDS {options.dataset}"
    precision, seed = config.step.precision, config.seed
    task = Task(build_model=lambda: build_model(options, precision, seed),
                train=MnistArrays(load, "train", where, options), evaluation=MnistArrays(load, "test", where, options),
                loss=LOSS, metrics=METRICS, optimizer=optimizer, callbacks=tuple(callbacks),
                signature=options.signature())
    return config, task
