"""Real multi-host networks on one machine: Linux network namespaces, veth pairs, a bridge.

A :class:`Topology` makes one namespace per host, each with an address on a private test
subnet (198.18.0.0/15 is reserved for network testing, RFC 2544), all wired to a bridge in
a switch namespace of their own. Nothing touches the machine's own network namespace, and
everything is removed on close, even after a failed test.

Processes join a host with :func:`enter_netns` (``setns(2)``) before they create any
socket, so the test harness's control pipes (inherited file descriptors) keep working
across namespaces.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import subprocess
from typing import Final

SUBNET: Final = "198.18.77"
CLONE_NEWNET: Final = 0x40000000


def why_unavailable() -> str | None:
    """``None`` when this machine can run namespace tests, else the reason."""
    if os.geteuid() != 0:
        return "multi-host tests need root (ip netns add): run them as root"
    if shutil.which("ip") is None:
        return "multi-host tests need iproute2 (the `ip` command): apt-get install iproute2"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=20)


def enter_netns(name: str) -> None:
    """Move the calling process into namespace ``name`` (before it opens any socket)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Topology:
    """Hosts on one switched subnet. ``address(host)`` is each host's IP."""

    def __init__(self, hosts: list[str]) -> None:
        self.tag = secrets.token_hex(3)
        self.switch = f"zs-{self.tag}-sw"
        self.hosts = {h: f"zs-{self.tag}-{h}" for h in hosts}
        self._addresses = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(hosts)}
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (host, ns) in enumerate(self.hosts.items()):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Interface names are at most 15 bytes: short names inside each namespace.
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                f"p{i}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self._addresses[host]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def address(self, host: str) -> str:
        return self._addresses[host]

    def namespace(self, host: str) -> str:
        return self.hosts[host]

    def link(self, host: str, up: bool) -> None:
        """Cut (``up=False``) or restore a host's only link, as a pulled cable would."""
        _ip("-n", self.hosts[host], "link", "set", "eth0", "up" if up else "down")

    def shape(self, host: str, *, rate: str, burst: str, latency: str) -> None:
        """Token-bucket shaping on a host's link: real queueing delay, and real packet
        loss (tail drop) once the queue is full. (This kernel has no netem.)"""
        # A qdisc shapes what leaves an interface: the host's eth0 for its own traffic,
        # the switch's port towards it for what it receives.
        port = f"p{list(self.hosts).index(host)}"
        for ns, dev in ((self.hosts[host], "eth0"), (self.switch, port)):
            subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    burst,
                    "latency",
                    latency,
                ],
                check=True,
                capture_output=True,
                text=True,
                timeout=20,
            )

    def close(self) -> None:
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
