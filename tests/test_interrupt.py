"""Signals while training: forked workers keep the default handlers, errors in them end the fit, exit statuses."""

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpupar.training.interrupt import StopRequests

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def _ended_by_sigterm(process) -> bool:
    """SIGTERMs a process, as multiprocessing's Pool.terminate() does; whether it ended within 10 s."""
    process.terminate()
    process.join(10)
    ended = process.exitcode == -signal.SIGTERM
    if process.exitcode is None:
        os.kill(process.pid, signal.SIGKILL)
        process.join()
    return ended


@pytest.mark.parametrize("forked_from", ["main thread", "another thread"])  # a PyDataset's pool forks from tf.data's
@pytest.mark.parametrize("when", ["once it runs", "as it starts"])  # Pool.terminate() can catch a worker starting
def test_a_process_forked_while_training_holds_the_signals_ends_on_sigterm(forked_from, when):
    context = multiprocessing.get_context("fork")
    running = context.Event()

    def sleep():
        running.set()
        time.sleep(60)

    with StopRequests():
        child = context.Process(target=sleep)
        starter = threading.Thread(target=child.start)
        if forked_from == "main thread":
            starter.run()
        else:
            starter.start()
            starter.join()
        if when == "once it runs":
            assert running.wait(30)
        assert _ended_by_sigterm(child)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # and this process has its own handler back


@pytest.mark.slow
def test_a_pydataset_whose_worker_processes_raise_ends_every_fit_within_seconds_with_the_users_error():
    """Before forked workers got their handlers back, 1 such fit in 3 (the issue) to 12 (here) hung for ever in the
    pool's terminate(); 30 of them would all have ended with a chance of 7% at most."""
    runs = 30
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, "raising_pydataset.py"), str(runs)], timeout=300,
                            capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    ended = re.findall(r"^run \d+: (\S+) s: (.*)$", result.stdout, re.MULTILINE)
    assert result.returncode == 0 and len(ended) == runs, result.stdout[-2000:] + result.stderr[-2000:]
    assert max(float(seconds) for seconds, _ in ended) < 30
    for _, said in ended:
        line, user_frame = said.split(" | ")
        assert line == "x: Unreadable[5] raised OSError: image 5 is unreadable"
        assert user_frame.endswith("in __getitem__")  # the worker process's traceback, into the user's code


SIGTERM_AT_STEP_3 = """
import os, signal, sys
import keras, numpy as np
import gpupar

x = np.random.default_rng(0).normal(size=(256, 6)).astype("float32")
y = (x[:, 0] > 0).astype("int32")
stop = keras.callbacks.LambdaCallback(
    on_train_batch_end=lambda batch, logs: batch == 2 and os.kill(os.getpid(), signal.SIGTERM))  # a scheduler's SIGTERM
gpupar.fit(lambda: keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)]), x, y, batch_size=32, epochs=2,
           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), callbacks=[stop], steps_per_call=1,
           model_dir=sys.argv[1], verbose=0)
print("not reached")
"""


@pytest.mark.slow
def test_a_script_whose_fit_a_signal_stopped_exits_with_128_plus_it_in_one_line_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-c", SIGTERM_AT_STEP_3, str(tmp_path / "run")], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    said = [line for line in (result.stdout + result.stderr).splitlines() if "SIGTERM" in line or "Traceback" in line]
    assert result.returncode == 143, result.stderr[-2000:]
    assert said == [f"SIGTERM received: saved {tmp_path / 'run' / 'within_epoch' / 'step-3'}"]
    assert "not reached" not in result.stdout


def test_launch_exits_with_the_shells_status_for_a_task_killed_by_a_signal():
    from launching import Launch

    launch = Launch(["--workers=2"], ["sh", "-c", "kill -KILL $$"])
    assert launch.finish(timeout=60) == 128 + signal.SIGKILL, launch.output[-2000:]
