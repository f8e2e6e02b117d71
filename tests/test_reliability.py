"""Faults and interruptions: every completed step checkpoint survives, nothing good is overwritten."""

import fcntl
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import gpupar
from gpupar.training.checkpoint import WITHIN_EPOCH
from gpupar.errors import GpuparError

# Deterministic: no dropout, fixed seed, data order fixed by (seed, step).
RUN = ["--epochs=3", "--per_replica_batch_size=16", "--dropout=0", "--seed=0", "--display_step=1", "--checkpoint_every_steps=2"]


def _fit(idx_dir, **options):
    defaults = dict(data_dir=idx_dir, epochs=1, per_replica_batch_size=16, dropout=0.0, seed=0, display_step=100)
    return gpupar.fit_mnist(**{**defaults, **options})


def _start(idx_dir, model_dir, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "gpupar", f"--data_dir={idx_dir}", f"--model_dir={model_dir}", "--resume", *RUN, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )


def _wait_for_line(process, text, timeout=120):
    """Reads stdout until a line containing text; returns everything read."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    process.kill()
    raise AssertionError(f"never printed {text!r}; got:\n{''.join(seen)}")


def _weights(model_dir, idx_dir):
    """The weights of the latest checkpoint in model_dir, as a resumed run restores them."""
    return _fit(idx_dir, model_dir=model_dir, resume=True, epochs=3).model.get_weights()


@pytest.fixture(scope="module")
def reference(shared_idx_dir):
    """The final weights of the same run, never interrupted."""
    return _fit(shared_idx_dir, epochs=3).model.get_weights()


def _close(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b)) < 1e-5


def test_step_checkpoints_and_mid_epoch_resume_match_an_uninterrupted_run(shared_idx_dir, tmp_path, reference):
    model_dir = str(tmp_path / "run")
    _fit(shared_idx_dir, model_dir=model_dir, epochs=1, checkpoint_every_steps=3, steps_per_epoch=None)
    assert sorted(os.listdir(os.path.join(model_dir, WITHIN_EPOCH))) == [
        "checkpoint", "step-15.data-00000-of-00001", "step-15.index"]  # the newest of steps 3, 6, .., 15
    resumed = _fit(shared_idx_dir, model_dir=model_dir, resume=os.path.join(model_dir, WITHIN_EPOCH, "step-15"),
                   epochs=3)
    # Step 16 of 16, then 2 epochs; the first epoch's record covers all 16 steps, 15 of them before.
    assert resumed.start_epoch == 0 and (resumed.records[0].steps, resumed.records[0].resumed_at_step) == (16, 15)
    assert _close(resumed.model.get_weights(), reference)


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_resume_finishes(shared_idx_dir, tmp_path, reference):
    model_dir = str(tmp_path / "run")
    process = _start(shared_idx_dir, model_dir)
    _wait_for_line(process, "Epoch:[1] [5 / 16]")
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, err[-2000:]
    assert "SIGTERM received: saved " in out
    assert "interrupted by SIGTERM (saved " in err and "resume with --resume" in err
    finish = _start(shared_idx_dir, model_dir)
    out, err = finish.communicate(timeout=300)
    assert finish.returncode == 0, err[-2000:]
    assert "resumed from" in out and "Epoch:[2] loss:" in out and "Epoch:[0]" not in out
    assert sorted(f for f in os.listdir(model_dir) if f.endswith(".index")) == [
        "ckpt-1.index", "ckpt-2.index", "ckpt-3.index"]
    assert _close(_weights(model_dir, shared_idx_dir), reference)


def test_second_signal_exits_at_once_without_saving():
    script = (
        "import os, signal, time\n"
        "from gpupar.training.interrupt import StopRequests\n"
        "with StopRequests() as stop:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.2)\n"
        "    print('first:', stop.signum, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)\n"
        "    print('not reached')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 143  # 128 + the first signal, SIGTERM
    assert f"first: {int(signal.SIGTERM)}" in result.stdout and "not reached" not in result.stdout
    assert "SIGINT again: exiting now, without saving" in result.stderr


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_at_most_the_steps_since_the_last_checkpoint(shared_idx_dir, tmp_path, reference):
    model_dir = str(tmp_path / "run")
    # Kill right after the progress line of three random global steps (a fixed seed), in order, so
    # each kill lands mid-run: during a step, a checkpoint save or an evaluation.
    targets = sorted(random.Random(7).sample(range(1, 41), 3))
    for target in targets:
        epoch, step = divmod(target - 1, 16)
        process = _start(shared_idx_dir, model_dir)
        _wait_for_line(process, f"Epoch:[{epoch}] [{step + 1} / 16]")
        process.kill()
        process.communicate(timeout=60)
        assert process.returncode == -signal.SIGKILL
    finish = _start(shared_idx_dir, model_dir)
    out, err = finish.communicate(timeout=300)
    assert finish.returncode == 0, err[-2000:]
    assert "resumed from" in out
    assert os.path.exists(os.path.join(model_dir, "ckpt-3.index"))
    assert _close(_weights(model_dir, shared_idx_dir), reference)


def test_second_run_on_the_same_model_dir_is_refused(shared_idx_dir, tmp_path):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    with open(model_dir / ".gpupar.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        with pytest.raises(GpuparError, match=r"is in use by another gpupar run \(pid 4242\)"):
            _fit(shared_idx_dir, model_dir=str(model_dir))
    assert os.listdir(model_dir) == [".gpupar.lock"]


def test_unwritable_model_dir_is_a_clear_error(shared_idx_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(GpuparError, match="cannot be written"):
        _fit(shared_idx_dir, model_dir=str(blocker / "run"))


def test_truncated_checkpoint_is_named_and_left_alone(shared_idx_dir, tmp_path):
    model_dir = tmp_path / "run"
    _fit(shared_idx_dir, model_dir=str(model_dir), epochs=1, steps_per_epoch=2)
    data_file = model_dir / "ckpt-1.data-00000-of-00001"
    data_file.write_bytes(data_file.read_bytes()[:1000])
    before = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}
    with pytest.raises(GpuparError) as e:
        _fit(shared_idx_dir, model_dir=str(model_dir), resume=True, epochs=2)
    assert f"{model_dir}/ckpt-1: cannot restore this checkpoint" in str(e.value)
    assert {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()} == before


def _poison_every_third_batch(monkeypatch):
    """Makes the images of every batch whose label sum is a multiple of 3 NaN (a poisoned batch)."""
    import tensorflow as tf

    from gpupar.data import mnist_images as mnist

    normalise = mnist.normalise

    def poisoned(images, labels):
        images, labels = normalise(images, labels)
        bad = tf.equal(tf.reduce_sum(labels) % 3, 0) & tf.greater(tf.shape(labels)[0], 16)
        return tf.where(bad, tf.constant(float("nan")), images), labels

    monkeypatch.setattr(mnist, "normalise", poisoned)


def _poisoned_per_epoch(idx_dir, epochs, global_batch):
    """How many of each epoch's batches the poison hits, read from the pipeline itself."""
    from gpupar.data import array_pipeline as pipeline, mnist_images as mnist
    from gpupar.data import idx

    splits = idx.load_idx_dir(idx_dir)
    per_epoch = len(splits.train_labels) // global_batch
    ds = pipeline.train_dataset((splits.train_images, splits.train_labels), global_batch, seed=0).map(mnist.normalise)
    hits = [int(np.isnan(x.numpy()).any()) for x, _ in ds.take(epochs * per_epoch)]
    return [sum(hits[e * per_epoch:(e + 1) * per_epoch]) for e in range(epochs)]


@pytest.mark.parametrize("kind", ["one_device", "mirrored"])
def test_nan_policy_skip_drops_poisoned_steps_and_keeps_training(shared_idx_dir, monkeypatch, kind):
    _poison_every_third_batch(monkeypatch)
    expected = _poisoned_per_epoch(shared_idx_dir, 2, 32)
    assert 0 < sum(expected) < 16
    result = _fit(shared_idx_dir, strategy=kind, virtual_cpus=2, per_replica_batch_size=32 // (2 if kind == "mirrored" else 1),
                  epochs=2, nan_policy="skip", display_step=1)
    assert [r.skipped_steps for r in result.records] == expected
    assert all(np.isfinite(w).all() for w in result.model.get_weights())  # BN statistics included
    assert np.isfinite(result.records[1].train_loss) and result.test_accuracy > 0.0


@pytest.mark.parametrize("steps_per_call", [1, None])
def test_nan_policy_stop_names_epoch_and_step(shared_idx_dir, monkeypatch, tmp_path, steps_per_call):
    _poison_every_third_batch(monkeypatch)
    from gpupar.data import array_pipeline as pipeline, mnist_images as mnist
    from gpupar.data import idx

    splits = idx.load_idx_dir(shared_idx_dir)
    batches = pipeline.train_dataset((splits.train_images, splits.train_labels), 32, seed=0).map(mnist.normalise).take(8)
    first_bad = 1 + [bool(np.isnan(x.numpy()).any()) for x, _ in batches].index(True)
    # One step per call names the step; by default a call is the whole 8-step epoch here (display_step
    # capped at the epoch), and the host only sees its sum.
    where = f"step {first_bad}" if steps_per_call == 1 else r"one of steps 1\.\.8"
    with pytest.raises(GpuparError, match=rf"training loss became nan at epoch 0, {where}; stopped without saving"):
        _fit(shared_idx_dir, per_replica_batch_size=32, epochs=2, display_step=100, model_dir=str(tmp_path / "run"),
             steps_per_call=steps_per_call)
    assert not os.path.exists(tmp_path / "run" / "ckpt-1.index")


@pytest.mark.slow
def test_full_disk_during_a_save_keeps_the_last_checkpoint(shared_idx_dir, tmp_path):
    import resource

    model_dir = tmp_path / "run"
    _fit(shared_idx_dir, model_dir=str(model_dir), epochs=1, steps_per_epoch=2)
    before = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file() and p.name != ".gpupar.lock"}

    def disk_nearly_full():
        # Writes past 100 kB fail with EFBIG, as on a full disk; a checkpoint is ~700 kB.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    result = subprocess.run(
        [sys.executable, "-m", "gpupar", f"--data_dir={shared_idx_dir}", f"--model_dir={model_dir}", "--resume",
         "--epochs=2", "--steps_per_epoch=2", "--per_replica_batch_size=16", "--dropout=0"],
        capture_output=True, text=True, timeout=300, preexec_fn=disk_nearly_full,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "could not write a checkpoint into" in last and f"the last complete checkpoint {model_dir}/ckpt-1 is intact" in last
    after = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file() and p.name != ".gpupar.lock"}
    assert {k: after[k] for k in before} == before
    assert _fit(shared_idx_dir, model_dir=str(model_dir), resume=True, epochs=1).start_epoch == 1


def test_many_skipped_steps_do_not_wear_out_the_loss_scale(shared_idx_dir, monkeypatch):
    """Each skip halves Keras' loss scale; unreset, it reaches 0 after ~150 skips and every step fails."""
    import tensorflow as tf

    from gpupar.data import mnist_images as mnist

    normalise = mnist.normalise

    def mostly_poisoned(images, labels):
        images, labels = normalise(images, labels)
        bad = tf.not_equal(tf.reduce_sum(labels) % 5, 0)
        return tf.where(bad, tf.constant(float("nan")), images), labels

    monkeypatch.setattr(mnist, "normalise", mostly_poisoned)
    result = _fit(shared_idx_dir, epochs=16, nan_policy="skip", display_step=16)
    skipped = sum(r.skipped_steps for r in result.records)
    assert 160 < skipped < 256  # most, not all, of the 256 steps: past where an unreset scale is 0
    assert result.records[-1].skipped_steps < 16  # the clean batches still train at the end


@pytest.mark.slow
def test_mid_epoch_checkpoint_resumes_with_another_global_batch(shared_idx_dir, tmp_path, capsys):
    model_dir = str(tmp_path / "run")
    _fit(shared_idx_dir, model_dir=model_dir, checkpoint_every_steps=6, steps_per_epoch=7)  # saves step 6
    path = os.path.join(model_dir, WITHIN_EPOCH, "step-6")
    assert os.path.exists(path + ".index")
    # 6 steps of 16 examples are 3 steps of 32 (two replicas of 16): the epoch goes on from step 3 of 8.
    result = _fit(shared_idx_dir, model_dir=model_dir, resume=path, strategy="mirrored", virtual_cpus=2)
    # The record covers the epoch: the 6 earlier steps of 16 and this run's 5 of 32.
    assert result.start_epoch == 0 and (result.records[0].steps, result.records[0].resumed_at_step) == (11, 3)
    assert "continues at step 3, on a data order of its own" in capsys.readouterr().out


def test_nan_gradient_behind_a_finite_loss_is_never_saved(tmp_path):
    import keras
    import tensorflow as tf

    @tf.custom_gradient
    def nan_backward(x):
        return tf.identity(x), lambda dy: dy * float("nan")

    def finite_loss_nan_gradient(labels, logits):
        return keras.losses.sparse_categorical_crossentropy(labels, nan_backward(logits), from_logits=True)

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    with pytest.raises(GpuparError, match=r"the weights became non-finite \(a NaN or Inf gradient\) by epoch 0, step 1"):
        gpupar.fit(lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), x, y,
                   loss=finite_loss_nan_gradient, epochs=1, steps_per_epoch=1, batch_size=16,
                   model_dir=str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "ckpt-1.index")
