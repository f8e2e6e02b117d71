"""Slow: real Fashion-MNIST (Debian's dataset-fashion-mnist) for a few hundred steps."""

import os

import pytest

import gpupar
from conftest import FASHION_MNIST


@pytest.mark.slow
def test_fashion_mnist_two_replicas_learns(tmp_path):
    assert os.path.exists(os.path.join(FASHION_MNIST, "train-images-idx3-ubyte.gz")), (
        "install the real data: apt-get install dataset-fashion-mnist (make test does it)"
    )
    result = gpupar.fit_mnist(
        dataset="fashion_mnist", data_dir=FASHION_MNIST, strategy="mirrored", virtual_cpus=2,
        per_replica_batch_size=128, epochs=2, steps_per_epoch=150, steps_per_call=10, display_step=50,
        model_dir=str(tmp_path / "run"),
    )
    assert sum(r.steps for r in result.records) == 300
    assert result.test_accuracy > 0.75  # chance is 0.10; this run reaches about 0.85
