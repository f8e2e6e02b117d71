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
