"""Gradient accumulation (accumulate_steps=N): one update from N batches equals one step on an N-times larger batch."""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import gpupar
from conftest import fit_data
from gpupar.errors import GpuparError

# SGD, so that a wrong scale (a micro-batch divided by its own denominator, the penalty added N
# times) shows in the weights.
ATOL = 1e-5
GLOBAL_BATCH = 32


def _data(num=256):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num, 6)).astype("float32")
    y = np.argmax(x[:, :4], axis=1).astype("int32")
    return x, y, np.where(y == 0, 3.0, 0.5).astype("float32")  # weights that differ between micro-batches


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6,)),
                             keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01)),
                             keras.layers.Dense(4)])


def _fit(replicas, accumulate_steps, batch_size=None, reduction="mean_with_sample_weight", **options):
    """One epoch of 4 updates of GLOBAL_BATCH examples (unless batch_size says otherwise)."""
    settings = dict(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction),
        optimizer=lambda: keras.optimizers.SGD(0.1), batch_size=batch_size or GLOBAL_BATCH // accumulate_steps,
        accumulate_steps=accumulate_steps, epochs=1, steps_per_epoch=4, save=False, display_step=100,
        strategy="one_device" if replicas == 1 else "mirrored", virtual_cpus=replicas if replicas > 1 else None)
    settings.update(options)
    return gpupar.fit(_model, **fit_data(_data()), **settings)


def _difference(a, b):
    """The largest difference between two models' weights (a FitResult's or a model's)."""
    weights = [getattr(m, "model", m).get_weights() for m in (a, b)]
    return max(float(np.max(np.abs(x - y))) for x, y in zip(*weights))


@pytest.mark.parametrize("reduction", ["mean_with_sample_weight", "sum_over_batch_size"])
@pytest.mark.parametrize("replicas, accumulate_steps", [(1, 4), (2, 2), (2, 4)])
def test_accumulated_batches_update_as_one_larger_batch(replicas, accumulate_steps, reduction):
    whole = _fit(1, 1, reduction=reduction)
    accumulated = _fit(replicas, accumulate_steps, reduction=reduction)
    assert _difference(whole, _model()) > 1e-2  # the updates moved the weights
    assert _difference(accumulated, whole) < ATOL
    assert abs(accumulated.records[0].logs["loss"] - whole.records[0].logs["loss"]) < ATOL
    assert accumulated.global_batch == whole.global_batch == GLOBAL_BATCH


def test_a_wrong_scale_would_show():
    # Control: one update per micro-batch, the batches of the accumulated run, is another result.
    assert _difference(_fit(1, 4), _fit(1, 1, batch_size=GLOBAL_BATCH // 4, steps_per_epoch=16)) > 1e-3


def test_checkpoints_land_on_update_boundaries_and_resume_as_if_never_stopped(tmp_path):
    options = dict(epochs=2, steps_per_epoch=None)  # 8 updates of 32 a pass
    straight = _fit(2, 2, **options)
    model_dir = str(tmp_path / "run")
    _fit(2, 2, save=True, model_dir=model_dir, checkpoint_every_steps=3, **{**options, "epochs": 1})
    steps = {name.split(".")[0] for name in os.listdir(os.path.join(model_dir, "within_epoch")) if "step-" in name}
    assert steps == {"step-6"}  # counted in updates: the newest step checkpoint, after 6 updates of 2 batches
    resumed = _fit(2, 2, save=True, model_dir=model_dir, resume=os.path.join(model_dir, "within_epoch", "step-6"),
                   **options)
    assert resumed.records[0].resumed_at_step == 6 and resumed.records[0].steps == 8
    assert _difference(resumed, straight) < 1e-6


def test_the_progress_line_counts_updates_and_examples(caplog):
    _fit(2, 2, display_step=2)
    assert "accumulation: each update adds the gradients of 2 micro-batches" in caplog.text
    assert "batch: 16 examples per step, 8 per replica on 2 replicas; 32 per update (2 accumulated)" in caplog.text
    assert "Epoch:[0] [2 / 4 updates, 64 examples] loss: " in caplog.text
    assert "Epoch:[0] [4 / 4 updates, 128 examples] loss: " in caplog.text


def test_bad_accumulation_options_are_one_line_before_any_step():
    for options, message in [
        (dict(accumulate_steps=0), "accumulate_steps=0: must be a whole number > 0"),
        (dict(accumulate_steps=2, strategy="model_parallel"), "accumulate_steps=2 adds up gradients in a synchronous"),
        (dict(optimizer=lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)),
         "pass accumulate_steps=2 to gpupar instead"),
        (dict(accumulate_steps=2, x=lambda context: tf.data.Dataset.from_tensor_slices(_data()[:2]).batch(8)),
         "accumulate_steps=2 makes each replica's batch 2 times larger, and a dataset_fn's batches are its own"),
    ]:
        with pytest.raises(GpuparError, match=re.escape(message)) as e:
            data = dict(x=options.pop("x")) if "x" in options else dict(zip("xy", _data()[:2]), batch_size=8)
            gpupar.fit(_model, **data, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), epochs=1,
                       save=False, **options)
        assert "\n" not in str(e.value)
