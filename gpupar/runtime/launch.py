"""`gpupar launch`: a cluster of processes on this machine, on loopback ports.

    gpupar launch --workers=2 -- --strategy=multi_worker_mirrored --epochs=2 --model_dir=runs/mw
    gpupar launch --workers=2 --ps=1 -- --strategy=parameter_server --epochs=2 --model_dir=runs/ps
    gpupar launch --workers=2 -- python train.py --epochs=2      # any script, e.g. one calling gpupar.fit

Each task is `python -m gpupar <flags>` (or, when what follows -- is a command rather than
flags, that command) with its own TF_CONFIG on 127.0.0.1 and a free port; its output lines are
prefixed with its task name. With ps tasks there is also a chief (the coordinator). The launcher
returns when the run is over: every task ended (synchronous), or the chief ended
(parameter-server mode; the servers are then stopped). A task that fails stops all the others;
with --restarts=N the whole cluster is started again, up to N times (parameter-server mode
restarts a failed worker alone: the coordinator retries its steps); gpupar's own flags get
--resume, a command runs again unchanged (a script that should resume passes resume=True).
Ctrl-C (or SIGTERM) sends SIGTERM to every task, so each saves a checkpoint, then SIGKILL after
a grace period. Every process it started is gone when it returns.
"""

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

from gpupar.errors import GpuparError
from gpupar.runtime import network
from gpupar.runtime.cluster import Cluster, tf_config
from gpupar.runtime.startup import start_up_line, wants_start_up_lines

GRACE_SECONDS = 30.0


def free_ports(count: int) -> List[int]:
    """Ports on 127.0.0.1 that nothing listens on now (held open together, so all differ)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def loopback_cluster(workers: int, ps: int) -> Dict[str, List[str]]:
    """Job -> addresses for `workers` workers and `ps` parameter servers (plus a chief when ps > 0)."""
    sizes = {"chief": 1, "worker": workers, "ps": ps} if ps else {"worker": workers}
    ports = iter(free_ports(sum(sizes.values())))
    return {job: [f"127.0.0.1:{next(ports)}" for _ in range(n)] for job, n in sizes.items()}


def visible_gpus(environ, nvidia_smi_lines: Optional[List[str]]) -> List[str]:
    """The GPUs the launcher may hand out: CUDA_VISIBLE_DEVICES' entries where it is set, else nvidia-smi -L's."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [e.strip() for e in environ["CUDA_VISIBLE_DEVICES"].split(",") if e.strip()]
    return [str(i) for i, line in enumerate(line for line in nvidia_smi_lines or () if line.startswith("GPU "))]


def assign_gpus(jobs: Dict[str, List[str]], gpus: List[str], per_worker: Optional[int] = None) -> Dict[str, List[str]]:
    """{task name: its GPUs}: the workers share the GPUs evenly, the chief and ps tasks get none.

    Two NCCL ranks on one GPU are unsupported and may hang ("Duplicate GPU detected"), so no GPU
    goes to two tasks. `per_worker` overrides the even split (0: every task on CPUs).

    Raises:
      GpuparError: more workers than GPUs, or per_worker GPUs more than there are.
    """
    workers = len(jobs.get("worker", ()))
    if per_worker is None:
        per_worker = len(gpus) // workers if gpus else 0
        if gpus and per_worker == 0:
            raise GpuparError(f"{workers} workers but {len(gpus)} GPU(s): a GPU cannot serve two workers (NCCL "
                              "refuses duplicate GPUs); use --workers at most the GPUs, or --gpus_per_worker=0 to "
                              "train on CPUs")
    if per_worker * workers > len(gpus):
        raise GpuparError(f"--gpus_per_worker={per_worker} for {workers} workers needs {per_worker * workers} GPUs, "
                          f"but {len(gpus)} are visible ({','.join(gpus) or 'none'})")
    assigned = {}
    for job, addresses in jobs.items():
        for index in range(len(addresses)):
            start = index * per_worker
            assigned[f"{job}:{index}"] = gpus[start:start + per_worker] if job == "worker" else []
    return assigned


def _nvidia_smi() -> List[str]:
    """nvidia-smi -L's lines, or [] where there is no NVIDIA driver."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return done.stdout.splitlines() if done.returncode == 0 else []


@dataclasses.dataclass
class TaskProcess:
    """One started process and its place in the cluster."""

    name: str
    cluster: Cluster
    process: subprocess.Popen
    reader: threading.Thread

    def status(self) -> Optional[int]:
        """Its exit status as a shell gives it (128 + the signal that killed it), or None while it runs."""
        code = self.process.poll()
        return 128 - code if code is not None and code < 0 else code


def _stream(prefix: str, pipe, out, lock, quiet: bool):
    """Relays a task's output, each line prefixed with its name; TensorFlow's C++ chatter left out where quiet."""
    for line in iter(pipe.readline, b""):
        text = line.decode(errors="replace")
        if quiet and start_up_line(text):
            continue
        with lock:
            out.write(f"[{prefix}] {text}")
            out.flush()
    pipe.close()


def task_command(args: List[str]) -> List[str]:
    """What every task runs: `python -m gpupar ARGS` when ARGS are flags, else ARGS as a command.

    Raises:
      GpuparError: a command that is not a program on PATH or a file that can run.
    """
    if args and not args[0].startswith("-"):
        if shutil.which(args[0]) is None:
            raise GpuparError(f"the command after -- ({args[0]!r}) is not a program on PATH or an executable file; "
                              "give one such as python train.py, or gpupar's own flags (--epochs=2 ...)")
        return list(args)
    return [sys.executable, "-m", "gpupar", *args]


def restart_command(command: List[str]) -> List[str]:
    """The command a restarted task runs: gpupar's own with --resume, anything else unchanged.

    A checkpoint left by the failed run must be resumed, not refused ("model_dir already holds
    checkpoints"); a script says so itself (gpupar.fit(..., resume=True)).
    """
    gpupar = [sys.executable, "-m", "gpupar"]
    if command[:3] != gpupar:
        return list(command)
    flags = command[3:]
    if any(f == "--resume" or f.startswith(("--resume=", "--resume_from", "--noresume")) for f in flags):
        return list(command)
    return [*command, "--resume"]


class Launcher:
    """Starts, watches and stops the tasks of one loopback cluster."""

    def __init__(self, workers: int, ps: int, args: List[str], restarts: int = 0, out=None,
                 gpus_per_worker: Optional[int] = None):
        self.jobs = loopback_cluster(workers, ps)
        self.gpus = visible_gpus(os.environ, _nvidia_smi())
        self.assigned = assign_gpus(self.jobs, self.gpus, gpus_per_worker)
        self.command, self.restarts = task_command(args), restarts
        self.out = out or sys.stdout
        self.lock = threading.Lock()
        self.tasks: Dict[str, TaskProcess] = {}
        self.stopping = None  # the signal that asked us to stop, if any

    def say(self, message: str):
        with self.lock:
            self.out.write(f"[launch] {message}\n")
            self.out.flush()

    def start(self, job: str, index: int, command: List[str]):
        cluster = Cluster({j: tuple(a) for j, a in self.jobs.items()}, job, index, "TF_CONFIG")
        env = dict(os.environ, TF_CONFIG=tf_config(cluster), PYTHONUNBUFFERED="1")
        quiet = not wants_start_up_lines(command, env)  # sets TF_CPP_MIN_LOG_LEVEL=2 unless asked for the lines
        gpus = self.assigned[cluster.task_name]
        if self.gpus:  # "" hides every GPU from a task that gets none
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        process = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,  # own process group
        )
        reader = threading.Thread(target=_stream, args=(cluster.task_name, process.stdout, self.out, self.lock, quiet),
                                  daemon=True)
        reader.start()
        self.tasks[cluster.task_name] = TaskProcess(cluster.task_name, cluster, process, reader)
        where = f"GPU(s) {','.join(gpus)}" if gpus else "no GPU" if self.gpus else "CPU"
        self.say(f"started {cluster.task_name} (pid {process.pid}) on {self.jobs[job][index]}, {where}")

    def start_all(self, command: List[str]):
        for job in ("ps", "worker", "chief"):
            for index in range(len(self.jobs.get(job, ()))):
                self.start(job, index, command)

    def kill(self, task: TaskProcess, sig=signal.SIGKILL):
        if task.process.poll() is None:
            try:
                os.killpg(task.process.pid, sig)
            except ProcessLookupError:
                pass

    def stop_all(self, sig=signal.SIGKILL, grace: float = GRACE_SECONDS):
        """Sends `sig` to every task's process group; SIGKILL whatever still runs after `grace` s."""
        for task in self.tasks.values():
            self.kill(task, sig)
        deadline = time.monotonic() + grace
        for task in self.tasks.values():
            try:
                task.process.wait(timeout=None if sig == signal.SIGKILL else max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self.say(f"{task.name} still runs {grace:.0f} s after {signal.Signals(sig).name}; killing it")
                self.kill(task)
                task.process.wait()
        for task in self.tasks.values():
            # Each task's group too: nothing the task started may outlive the launcher.
            try:
                os.killpg(task.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            task.reader.join(timeout=5)
        self.tasks.clear()

    def _finished(self) -> Optional[int]:
        """The run's exit status once it is over, else None.

        Synchronous: over when every task ended, or one failed. Parameter-server mode: over when
        the chief ended or a ps task died (workers are _failed_ps_worker's business).
        """
        if "ps" in self.jobs:
            for task in self.tasks.values():
                code = task.status()
                if task.cluster.task_type == "chief" and code is not None:
                    return code
                if task.cluster.task_type == "ps" and code is not None:
                    return code or 1
            return None
        codes = [task.status() for task in self.tasks.values()]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        return 0 if all(c == 0 for c in codes) else None

    def _watch(self) -> int:
        while True:
            if self.stopping is not None:
                self.say(f"{signal.Signals(self.stopping).name}: stopping every task (SIGTERM; they save first)")
                chief = self.tasks.get("chief:0")
                if chief is not None:  # parameter servers: the coordinator saves while its servers still run
                    self.kill(chief, signal.SIGTERM)
                    try:
                        chief.process.wait(timeout=GRACE_SECONDS)
                    except subprocess.TimeoutExpired:
                        pass
                self.stop_all(signal.SIGTERM)
                return 128 + self.stopping
            status = self._finished()
            if status is not None:
                return status
            failed = self._failed_ps_worker()
            if failed is not None:
                return failed
            time.sleep(0.2)

    def _failed_ps_worker(self) -> Optional[int]:
        """In parameter-server mode, restarts a worker that died (if restarts are left)."""
        if "ps" not in self.jobs:
            return None
        for task in list(self.tasks.values()):
            code = task.process.poll()
            if task.cluster.task_type == "worker" and code is not None:
                if self.restarts <= 0:
                    self.say(f"{task.name} ended with status {code}; no restarts left")
                    return task.status() or 1
                self.restarts -= 1
                task.reader.join(timeout=5)
                self.say(f"{task.name} ended with status {code}; restarting it ({self.restarts} restart(s) left)")
                self.start(task.cluster.task_type, task.cluster.task_index, restart_command(self.command))
        return None

    def run(self) -> int:
        """Runs the cluster to the end; returns the exit status (that of the failing task, if any)."""
        while True:
            self.start_all(self.command)
            try:
                status = self._watch()
            finally:
                failed = [f"{t.name}: {t.process.poll()}" for t in self.tasks.values() if t.process.poll() not in (None, 0)]
                self.stop_all()
            if status == 0 or self.stopping is not None:
                return status
            if self.restarts <= 0:
                self.say(f"task(s) failed ({', '.join(failed) or status}); stopped every task")
                return status
            self.restarts -= 1
            restarted = restart_command(self.command)
            how = "with --resume" if restarted != self.command else "with the same command"
            self.command = restarted
            self.say(f"task(s) failed ({', '.join(failed)}); restarting the cluster {how} "
                     f"({self.restarts} restart(s) left)")
            self.jobs = loopback_cluster(len(self.jobs["worker"]), len(self.jobs.get("ps", ())))


def launch(workers: int, ps: int, restarts: int, args: List[str], gpus_per_worker: Optional[int] = None,
           allow_network: bool = False) -> int:
    """Runs `python -m gpupar ARGS` (or the command ARGS) as a loopback cluster of `workers` workers and `ps` ps tasks.

    Each worker gets its own GPUs (assign_gpus); the chief and ps tasks none. The tasks run in a
    private network namespace (gpupar.runtime.network): the launcher re-runs itself there, unless
    allow_network.

    Returns:
      The exit status: that of the failing task, if any (128 + the signal that killed it, as a
      shell says), or 128 + the signal that stopped the launcher.

    Raises:
      GpuparError: GPUs that cannot be shared out, or no private network without allow_network
        (before any task starts).
    """
    task_command(args)  # a command that cannot run is refused before anything starts
    inside = os.environ.get(network.PRIVATE_ENV) == "1"
    isolation = network.plan_isolation(inside, allow_network, None if inside or allow_network
                                       else network.working_unshare())
    if isolation.prefix:
        own = [f"--workers={workers}", f"--ps={ps}", f"--restarts={restarts}"]
        if gpus_per_worker is not None:
            own.append(f"--gpus_per_worker={gpus_per_worker}")
        return network.run_inside(isolation.prefix, [sys.executable, "-m", "gpupar", "launch", *own, "--", *args])
    if inside:
        network.bring_loopback_up()
    launcher = Launcher(workers, ps, args, restarts, gpus_per_worker=gpus_per_worker)
    launcher.say(isolation.note)

    def on_signal(signum, _frame):
        if launcher.stopping is not None:  # a second Ctrl-C: no more waiting
            launcher.stop_all()
            os._exit(128 + launcher.stopping)
        launcher.stopping = signum

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    return launcher.run()
