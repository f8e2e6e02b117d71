"""Who can reach a cluster task's server: a private network for `gpupar launch`, a warning elsewhere.

TensorFlow's distributed runtime (the gRPC server of every worker and ps task) has no
authentication or encryption: whoever reaches a task's port can run operations in it. Its
servers listen on every interface ([::]:PORT) whatever address the cluster names, and
TensorFlow has no option to bind them to loopback. So the local launcher runs its tasks in a
network namespace of their own (`unshare --net`), which has only a loopback interface: the tasks
reach each other on 127.0.0.1 and nothing outside reaches them. On real clusters that is the
network's job (docs/multi-machine.md); a task that other machines can reach says so in its log.

`plan_isolation` and `reachable_interfaces` are pure; the rest probes, re-runs and asks the kernel.
"""

import ctypes
import dataclasses
import fcntl
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from typing import List, Optional, Sequence, Tuple

from gpupar.errors import GpuparError

log = logging.getLogger("gpupar")

PRIVATE_ENV = "GPUPAR_PRIVATE_NETWORK"  # set in the launcher re-run inside the namespace
# unshare's ways to make a network namespace: a user namespace lets a non-root user do it too.
UNSHARE_OPTIONS = (("--net", "--map-root-user"), ("--net",))
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class Isolation:
    """How the launcher keeps its tasks' servers from other machines.

    Attributes:
      prefix: The command to run the launcher under (unshare ...), or () to run it as it is.
      note: What the launcher says about it, once.
    """

    prefix: Tuple[str, ...]
    note: str


def plan_isolation(inside: bool, allow_network: bool, unshare: Optional[Sequence[str]]) -> Isolation:
    """Decides where the launcher's tasks run, from what this machine allows.

    Args:
      inside: This launcher already runs in the private namespace (PRIVATE_ENV is set).
      allow_network: The user accepts tasks that other machines can reach (--allow_network).
      unshare: The unshare command that made a network namespace here, or None if none did.

    Returns:
      An Isolation.

    Raises:
      GpuparError: no private network is possible and allow_network was not given.
    """
    if inside:
        return Isolation((), "tasks in a private network namespace: nothing outside this launcher reaches their ports")
    if allow_network:
        return Isolation((), "--allow_network: the tasks' TensorFlow servers accept unauthenticated connections "
                             "from any machine that reaches this one")
    if unshare is None:
        raise GpuparError(
            "cannot give the cluster's tasks a private network (needs Linux and `unshare --net`, which this machine "
            "does not allow), and their TensorFlow servers would accept unauthenticated connections from any "
            "machine: run where network namespaces work, or pass --allow_network on a network you trust")
    return Isolation(tuple(unshare), "")


def reachable_interfaces(interfaces: Sequence[str]) -> List[str]:
    """The network interfaces through which other machines may reach this one (all but loopback)."""
    return sorted(i for i in interfaces if i != "lo")


def working_unshare() -> Optional[Tuple[str, ...]]:
    """The first unshare command that makes a network namespace on this machine, or None."""
    unshare = shutil.which("unshare") if sys.platform.startswith("linux") else None
    if unshare is None:
        return None
    for options in UNSHARE_OPTIONS:
        try:
            if subprocess.run([unshare, *options, "true"], capture_output=True, timeout=30).returncode == 0:
                return (unshare, *options)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


def bring_loopback_up():
    """Sets `lo` up in this network namespace (a new namespace starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


def _die_with_parent():
    """In the child, before exec: SIGTERM when the launcher that started it dies (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_inside(prefix: Sequence[str], argv: Sequence[str]) -> int:
    """Runs `argv` under `prefix` (unshare ...) with PRIVATE_ENV set; returns its exit status.

    The child has a session of its own, so a Ctrl-C reaches it once, forwarded from here, and
    keeps its meaning (a second one kills at once); it gets SIGTERM if this process dies.
    """
    child = subprocess.Popen([*prefix, *argv], env={**os.environ, PRIVATE_ENV: "1"}, start_new_session=True,
                             preexec_fn=_die_with_parent)

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, forward)
    status = child.wait()
    return 128 - status if status < 0 else status


_warned = False


def warn_if_reachable(task_name: str, address: str):
    """Logs once per process when this task's server can be reached from other machines."""
    global _warned
    try:
        interfaces = [name for _, name in socket.if_nameindex()]  # this namespace's (not /sys, which may be another's)
    except OSError:  # no way to tell: assume the worst
        interfaces = ["unknown"]
    others = reachable_interfaces(interfaces)
    if others and not _warned:
        _warned = True
        port = address.rsplit(":", 1)[-1]
        log.warning("%s: TensorFlow's server listens on port %s of every interface (%s), with no authentication: "
                    "keep the cluster on a private network or behind a firewall (docs/multi-machine.md)",
                    task_name, port, ", ".join(others))
