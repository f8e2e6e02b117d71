"""Running `gpupar launch` from a test, with a deadline, and checking that no task outlives it."""

import os
import re
import signal
import subprocess
import sys
import threading
import time


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def task_pids(output: str):
    """{task name: [pids]} from the launcher's '[launch] started worker:0 (pid N)' lines."""
    pids = {}
    for name, pid in re.findall(r"\[launch\] started (\S+) \(pid (\d+)\)", output):
        pids.setdefault(name, []).append(int(pid))
    return pids


class Launch:
    """`python -m gpupar launch ARGS -- FLAGS` in its own process group, its output collected."""

    def __init__(self, args, flags, cwd=None):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpupar", "launch", *args, "--", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=cwd,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line)

    def task_pids(self):
        return task_pids(self.output)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """Waits until a line matches `pattern`; fails the test on timeout or when the launcher ends."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.output, re.MULTILINE)
            if match:
                return match
            if self.process.poll() is not None and not self.reader.is_alive():
                raise AssertionError(f"launcher ended before {pattern!r}:\n{self.output[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.output[-4000:]}")

    def kill_when(self, pattern: str, task: str, timeout: float = 120):
        """SIGKILLs `task` (its newest process) once a line matches `pattern`, as a machine that dies would; the match."""
        match = self.wait_for(pattern, timeout)
        os.kill(self.task_pids()[task][-1], signal.SIGKILL)
        return match

    def finish(self, timeout: float) -> int:
        """The launcher's exit status; on timeout it and every task are killed and the test fails."""
        try:
            status = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            status = None
        finally:
            self.kill_all()
        self.reader.join(timeout=10)
        assert status is not None, f"launcher still running after {timeout} s:\n{self.output[-4000:]}"
        return status

    def kill_all(self):
        """SIGKILL to the launcher's group and to every task it started (each has its own group)."""
        groups = [self.process.pid] + [p for ps in task_pids(self.output).values() for p in ps]
        for pid in groups:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.process.poll() is None:
            self.process.wait()

    def assert_no_strays(self):
        """Every task process the launcher started is gone."""
        pids = [p for ps in task_pids(self.output).values() for p in ps]
        assert pids, self.output[-2000:]
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)], f"stray task processes: {pids}"
