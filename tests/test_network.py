"""Who can reach a launched cluster's servers: the decision (pure), then what real tasks listen on."""

import os
import re
import signal
import socket
import sys

import pytest

from gpupar.errors import GpuparError
from gpupar.runtime.network import plan_isolation, reachable_interfaces
from launching import Launch

USER_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "user_fit.py")
UNSHARE = ("/usr/bin/unshare", "--net", "--map-root-user")


def test_the_launcher_reruns_itself_in_a_private_network_when_it_can():
    assert plan_isolation(inside=False, allow_network=False, unshare=UNSHARE).prefix == UNSHARE
    inside = plan_isolation(inside=True, allow_network=False, unshare=None)
    assert inside.prefix == () and "private network namespace" in inside.note


def test_without_a_private_network_it_refuses_unless_allowed():
    with pytest.raises(GpuparError, match=r"cannot give the cluster's tasks a private network.*--allow_network"):
        plan_isolation(inside=False, allow_network=False, unshare=None)
    allowed = plan_isolation(inside=False, allow_network=True, unshare=None)
    assert allowed.prefix == () and "unauthenticated connections from any machine" in allowed.note


def test_only_loopback_is_private():
    assert reachable_interfaces(["lo"]) == []
    assert reachable_interfaces(["lo", "eth0", "docker0"]) == ["docker0", "eth0"]


def _listening_ports(pid):
    """The TCP ports a process's network namespace listens on (/proc/PID/net/tcp and tcp6)."""
    ports = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{name}") as table:
            for row in list(table)[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A":  # LISTEN
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def _refused(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) != 0


def _started(launch):
    """(pid, port) of worker:0 once training is under way."""
    launch.wait_for(r"\[worker:0\] Epoch:\[0\] loss:", timeout=120)
    match = re.search(r"\[launch\] started worker:0 \(pid (\d+)\) on 127\.0\.0\.1:(\d+)", launch.output)
    return int(match[1]), int(match[2])


def _stop(launch):
    """SIGTERM to the launcher, as a scheduler would: every task stops, none is left."""
    launch.process.send_signal(signal.SIGTERM)
    status = launch.finish(timeout=120)
    launch.assert_no_strays()
    return status


@pytest.mark.slow
def test_launched_tasks_listen_where_nothing_outside_reaches_them(tmp_path):
    launch = Launch(["--workers=2"], [sys.executable, USER_SCRIPT, str(tmp_path / "model"), "multi_worker_mirrored", "200"])
    try:
        pid, port = _started(launch)
        # TensorFlow's server listens on every interface of the task's namespace...
        assert port in _listening_ports(pid)
        # ...which is not this one: from here (the same machine, outside the launcher) it is closed.
        assert _refused(port)
        assert "private network namespace" in launch.output and "listens on port" not in launch.output
    finally:
        status = _stop(launch)
    assert status == 143, launch.output[-3000:]


@pytest.mark.slow
def test_allow_network_leaves_the_servers_reachable_and_each_task_says_so(tmp_path):
    launch = Launch(["--workers=2", "--allow_network"],
                    [sys.executable, USER_SCRIPT, str(tmp_path / "model"), "multi_worker_mirrored", "200"])
    try:
        pid, port = _started(launch)
        assert port in _listening_ports(pid) and not _refused(port)
        assert "--allow_network: the tasks' TensorFlow servers accept unauthenticated connections" in launch.output
        warnings = re.findall(r"\[(worker:\d)\] .*listens on port \d+ of every interface", launch.output)
        assert sorted(warnings) == ["worker:0", "worker:1"], launch.output[-3000:]
    finally:
        status = _stop(launch)
    assert status == 143, launch.output[-3000:]
