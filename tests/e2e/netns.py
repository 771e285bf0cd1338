"""Two "nodes" on one machine for the multi-node tests: two network namespaces joined by a veth pair.

Each namespace has loopback and one interface, named INTERFACE in both (so one GLOO_SOCKET_IFNAME serves
every node), with an address of a private /30 that exists only inside the two namespaces: no traffic leaves
them. `in_namespace` wraps a command to run in one of them, with a hosts file of the nodes' names bind-mounted
over /etc/hosts in a mount namespace of its own (the machine's /etc/hosts is not touched).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.conftest import system_tests_enabled

INTERFACE = "ptdpv"
SYSTEM_TEST = pytest.mark.skipif(not system_tests_enabled(), reason="system test: set PTDP_SYSTEM_TESTS=1")


@dataclass(frozen=True)
class Node:
    """One namespace: its name, its address and the node name the hosts file gives that address."""

    namespace: str
    address: str
    hostname: str


def tp2_pp2(iters: int, *extra: str) -> tuple[str, ...]:
    """Overrides of a tp 2 x pp 2 run of `iters` iterations without evaluation; [2:] is its one-process twin."""
    return ("parallel.tp_size=2", "parallel.pp_size=2", f"train.train_iters={iters}", "train.eval_interval=1000") + (
        "train.eval_iters=1",
        *extra,
    )


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def unavailable(reason: str) -> None:
    """Skip with the reason; under CI=true (CI runs as root on this kind of machine) fail instead."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the multi-node tests: {reason}")
    pytest.skip(reason)


def namespace_pids(node: Node) -> list[int]:
    """The processes inside the node's namespace."""
    return [int(pid) for pid in _ip("netns", "pids", node.namespace).stdout.split()]


@contextlib.contextmanager
def two_nodes(tag: str, addresses: tuple[str, str], hosts_file: str) -> Iterator[list[Node]]:
    """Create the two namespaces (named <tag>n0, <tag>n1) and the hosts file; on exit end every process left
    in them (by pid: they are this test's) and delete them, which removes the veth pair too."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nsenter"):
        unavailable("network namespaces need root, iproute2 and nsenter")
    nodes = [Node(f"{tag}n{i}", address, f"node{i}") for i, address in enumerate(addresses)]
    with open(hosts_file, "w", encoding="ascii") as handle:
        handle.write("127.0.0.1 localhost\n" + "".join(f"{n.address} {n.hostname}\n" for n in nodes))
    created: list[Node] = []
    try:
        for node in nodes:
            proc = _ip("netns", "add", node.namespace)
            if proc.returncode:
                unavailable(f"`ip netns add` is not permitted here: {proc.stderr.strip()}")
            created.append(node)
        first, second = nodes
        steps = [
            ("link", "add", INTERFACE, "netns", first.namespace, "type", "veth")
            + ("peer", "name", INTERFACE, "netns", second.namespace),
            *[("-n", n.namespace, "link", "set", "lo", "up") for n in nodes],
            *[("-n", n.namespace, "addr", "add", f"{n.address}/30", "dev", INTERFACE) for n in nodes],
            *[("-n", n.namespace, "link", "set", INTERFACE, "up") for n in nodes],
        ]
        for step in steps:
            proc = _ip(*step)
            if proc.returncode:
                unavailable(f"`ip {' '.join(step)}` failed: {proc.stderr.strip()}")
        yield nodes
    finally:
        for node in created:
            for pid in namespace_pids(node):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            _ip("netns", "del", node.namespace)


def in_namespace(node: Node, hosts_file: str, command: list[str]) -> list[str]:
    """`command` run inside the node's network namespace with the nodes' hosts file as /etc/hosts. Only the
    network namespace is switched (nsenter, not `ip netns exec`, which remounts /sys and hides the cgroup
    mounts slurmd needs)."""
    script = 'mount --bind "$0" /etc/hosts && exec "$@"'
    return ["nsenter", f"--net=/run/netns/{node.namespace}", "unshare", "-m", "sh", "-c", script, hosts_file, *command]
