"""Augmentation: the host and device placements warp alike, and every replica draws its own warps."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import synthetic_digits
from gpupar.data import augment
from gpupar.data import array_pipeline as pipeline, mnist_images as mnist
from gpupar.runtime.strategy import build_strategy, detected_plan


def _images(num, seed=1):
    images, _ = synthetic_digits(num, seed)
    return tf.cast(images, tf.float32)[..., tf.newaxis] / 255.0


def test_numpy_warp_is_the_tensorflow_warp():
    images = _images(32)
    seed = tf.constant([3, 4], tf.int64)
    on_device = augment.random_affine(images, seed).numpy()
    transforms = augment._transforms(augment._draws(32, seed), 28, 28).numpy()
    on_host = np.stack([augment.warp_numpy(image, t) for image, t in zip(images.numpy(), transforms)])
    assert np.abs(on_device - images.numpy()).mean() > 0.02  # the warps really move pixels
    np.testing.assert_allclose(on_host, on_device, atol=1e-5)


def _features(images):
    """Per image: total brightness and the brightness-weighted centre (row, column)."""
    mass = images.sum(axis=(1, 2, 3))
    rows, cols = np.mgrid[0:28, 0:28]
    weights = images[..., 0]
    return np.stack([mass, (weights * rows).sum(axis=(1, 2)) / mass, (weights * cols).sum(axis=(1, 2)) / mass], 1)


def test_host_pipeline_and_device_step_give_the_same_distribution():
    digit = synthetic_digits(1, 5)[0][0]
    count = 1024
    images, labels = np.repeat(digit[np.newaxis], count, axis=0), np.zeros(count, np.uint8)
    host_batch, _ = next(iter(pipeline.train_dataset((images, labels), count, seed=0, example_map=mnist.host_augmentation(0))))
    plain = tf.cast(images, tf.float32)[..., tf.newaxis] / 255.0
    device_batch = augment.random_affine(plain, augment.device_seed(0, tf.constant(5)))
    host, device, original = _features(host_batch.numpy()), _features(device_batch.numpy()), _features(plain.numpy())
    assert host[:, 1:].std(axis=0).min() > 0.5  # shifts of up to 2.8 pixels move the centre
    assert np.abs(host.mean(axis=0) - original.mean(axis=0))[1:].max() < 0.3  # ... symmetrically
    # Means agree to within a fraction of a standard deviation; 1024 draws put the noise near 0.05.
    assert (np.abs(host.mean(axis=0) - device.mean(axis=0)) < 0.2 * host.std(axis=0)).all()
    np.testing.assert_allclose(host.std(axis=0), device.std(axis=0), rtol=0.15)


def test_host_warps_differ_per_example_and_repeat_for_the_same_seed():
    images, labels = synthetic_digits(64, 1)
    first = next(iter(pipeline.train_dataset((images, labels), 64, seed=0, example_map=mnist.host_augmentation(0))))[0].numpy()
    again = next(iter(pipeline.train_dataset((images, labels), 64, seed=0, example_map=mnist.host_augmentation(0))))[0].numpy()
    plain = next(iter(pipeline.train_dataset((images, labels), 64, seed=0).map(mnist.normalise)))[0].numpy()
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, plain)


def test_every_replica_warps_its_images_its_own_way():
    strategy = build_strategy(detected_plan("mirrored", max_cpus=2))
    images = _images(8)

    def warp():
        return augment.random_affine(images, augment.device_seed(0, tf.constant(1)))

    first, second = strategy.experimental_local_results(strategy.run(tf.function(warp)))
    assert np.abs(first.numpy() - second.numpy()).max() > 0.1


@pytest.mark.parametrize("placement", ["host", "device"])
def test_resumed_run_warps_as_an_uninterrupted_one(shared_idx_dir, tmp_path, placement):
    import gpupar

    options = dict(data_dir=shared_idx_dir, batch_size=16, steps_per_epoch=3, dropout=0.0, augment=True,
                   augment_on=placement)
    whole = gpupar.fit_mnist(epochs=2, **options)
    gpupar.fit_mnist(epochs=1, model_dir=str(tmp_path), **options)
    resumed = gpupar.fit_mnist(epochs=2, model_dir=str(tmp_path), resume=True, **options)
    for a, b in zip(whole.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
