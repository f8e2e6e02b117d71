"""The TF1 tower baseline: the same ConvNet, a tower per device, and it learns."""

import numpy as np

from gpupar.models.convnet import build_convnet
from benchmarks.towers import TowerTrainer, tower_devices


def test_towers_go_to_gpus_when_there_are_enough_else_to_cpu_devices():
    assert tower_devices(2, num_gpus=2) == ["/gpu:0", "/gpu:1"]
    assert tower_devices(2, num_gpus=1) == ["/cpu:0", "/cpu:1"]
    assert tower_devices(1, num_gpus=0) == ["/cpu:0"]


def test_the_towers_train_gpupars_convnet_on_one_device_each():
    trainer = TowerTrainer(towers=2, batch_size=32)
    keras_model = build_convnet()
    assert trainer.num_parameters == sum(int(np.prod(v.shape)) for v in keras_model.trainable_variables)
    placed = {op.device for op in trainer.graph.get_operations() if op.type == "Conv2D"}
    assert placed == {"/device:CPU:0", "/device:CPU:1"}
    assert {op.device for op in trainer.graph.get_operations() if op.type == "VarHandleOp"} == {"/device:CPU:0"}

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 64)
    images = np.zeros((64, 28, 28, 1), np.float32)
    images[np.arange(64), labels * 2, labels * 2, 0] = 1.0  # the class is where the one bright pixel is
    losses = [trainer.step(images, labels) for _ in range(60)]
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
