"""The input pipeline: order, resume position, full test coverage, and the TFDS source."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from gpupar.data import array_pipeline as pipeline, mnist_images as mnist
from gpupar.errors import GpuparError

IMAGES = np.arange(40 * 28 * 28, dtype=np.int64).reshape(40, 28, 28) % 251
LABELS = np.arange(40, dtype=np.int32)


def _labels_of(ds, n):
    return [b[1].numpy().tolist() for b in ds.take(n)]


def test_the_presets_batches_are_normalised_and_full():
    from gpupar.config import Config
    from gpupar.data.idx import Splits
    from gpupar.presets.mnist import MnistArrays
    from gpupar.presets.mnist_options import MnistOptions

    splits = Splits(IMAGES.astype(np.uint8), LABELS, IMAGES.astype(np.uint8), LABELS)
    adapter = MnistArrays(lambda: splits, "train", "memory", MnistOptions())
    adapter.prepare(Config().input, 0)
    images, labels = next(iter(adapter.batches(8)))
    assert images.shape == (8, 28, 28, 1) and images.dtype == tf.float32
    assert 0.0 <= float(tf.reduce_min(images)) and float(tf.reduce_max(images)) <= 1.0


def test_each_pass_is_a_new_permutation_of_every_example():
    batches = _labels_of(pipeline.train_dataset((IMAGES.astype(np.uint8), LABELS), 8, seed=0), 10)
    first, second = sum(batches[:5], []), sum(batches[5:], [])
    assert sorted(first) == sorted(second) == list(range(40))
    assert first != second


def test_order_depends_on_the_seed():
    ds = lambda seed: pipeline.train_dataset((IMAGES.astype(np.uint8), LABELS), 8, seed=seed)  # noqa: E731
    assert _labels_of(ds(0), 3) == _labels_of(ds(0), 3) != _labels_of(ds(1), 3)


def test_resumed_stream_continues_where_the_run_stopped():
    full = _labels_of(pipeline.train_dataset((IMAGES.astype(np.uint8), LABELS), 8, seed=3), 17)
    resumed = _labels_of(pipeline.train_dataset((IMAGES.astype(np.uint8), LABELS), 8, seed=3, start_step=7), 10)
    assert resumed == full[7:]


def test_each_pass_ends_with_a_partial_batch_as_in_keras():
    sizes = [len(b[1]) for b in pipeline.train_dataset((IMAGES.astype(np.uint8), LABELS), 16, seed=0).take(6)]
    assert sizes == [16, 16, 8, 16, 16, 8] and pipeline.batches_per_epoch(len(LABELS), 16) == 3
    larger = [sorted(b[1].numpy()) for b in pipeline.train_dataset((IMAGES.astype(np.uint8), LABELS), 64, seed=0).take(2)]
    assert larger == [list(range(40))] * 2  # a batch larger than the data: the whole set, every pass


@pytest.mark.parametrize("augment", [False, True], ids=["gather", "example_map"])
def test_batches_have_a_static_first_dimension_where_every_batch_is_full(augment):
    """As Keras' array adapter: a recurrent layer's loops then skip shape ops at every time step."""
    example_map = (lambda example, number, position: example) if augment else None
    arrays = (IMAGES.astype(np.uint8), LABELS)
    full = pipeline.train_dataset(arrays, 8, seed=0, example_map=example_map)
    partial = pipeline.train_dataset(arrays, 16, seed=0, example_map=example_map)
    assert full.element_spec[0].shape.as_list() == [8, 28, 28] and full.element_spec[1].shape.as_list() == [8]
    assert partial.element_spec[0].shape.as_list() == [None, 28, 28]
    resumed = pipeline.train_dataset(arrays, 8, seed=0, start_step=3, example_map=example_map)
    assert _labels_of(resumed, 4) == _labels_of(full, 7)[3:]  # nothing dropped: every example, every pass
    assert pipeline.eval_dataset(arrays, 8).element_spec[1].shape.as_list() == [8]
    assert pipeline.eval_dataset(arrays, 16).element_spec[1].shape.as_list() == [None]


def test_without_shuffle_the_batches_keep_the_arrays_order():
    batches = pipeline.train_dataset((IMAGES.astype(np.uint8), LABELS), 16, seed=0, shuffle=False).take(4)
    assert [list(b[1].numpy()) for b in batches] == [list(range(16)), list(range(16, 32)), list(range(32, 40)),
                                                     list(range(16))]


@pytest.mark.parametrize("devices", [["/cpu:0"], ["/cpu:0", "/cpu:1", "/cpu:2"]])
def test_test_pass_covers_every_example_once_partial_batch_included(devices):
    strategy = tf.distribute.MirroredStrategy(devices)
    global_batch = 6 * len(devices)
    ds = pipeline.eval_dataset((IMAGES.astype(np.uint8), LABELS), global_batch).repeat()
    it = iter(strategy.experimental_distribute_dataset(ds))
    steps = pipeline.test_steps(len(LABELS), global_batch)
    for _ in range(2):  # the same persistent iterator serves every evaluation
        seen = []
        for _ in range(steps):
            per_replica = strategy.experimental_local_results(next(it)[1])
            seen += [int(x) for part in per_replica for x in part.numpy()]
        assert sorted(seen) == list(range(40))


def test_tfds_source_under_mock_data():
    with tfds.testing.mock_data(num_examples=24):
        splits = mnist.load_splits("mnist")
    assert splits.train_images.shape == (24, 28, 28) and splits.train_images.dtype == np.uint8
    assert splits.test_labels.shape == (24,) and splits.test_labels.dtype == np.int32


def test_tfds_failure_says_how_to_use_local_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    with pytest.raises(GpuparError) as e:
        mnist.load_tfds("mnist", download=False)
    assert "could not load TFDS dataset 'mnist'" in str(e.value) and "--data_dir" in str(e.value)
