"""Emulated hosts on one machine, for tests and benchmarks of topology-aware training: a network
namespace per host, joined through a switch namespace by veth pairs whose traffic between hosts
is rate-limited for real (``tc``'s token bucket filter on both ends of each host's link) and,
where the kernel has ``sch_netem``, delayed -- not slept.

Processes of one host run inside its namespace (:meth:`EmulatedHosts.command`) and reach each
other at the host's address, which Linux delivers over the namespace's loopback: full speed.
Processes of different hosts talk through the veth pairs and the switch's bridge, at the set
rate and delay each way. Everything lives in namespaces this module creates and deletes (the
veth ends are created inside them): no interface, route or rule of the machine's own namespace
is touched, and the addresses (``10.213.<n>.<host + 1>``) are reachable only inside them.

Needs root (``CAP_NET_ADMIN``), iproute2 and the ``tbf`` qdisc; :func:`available` says whether
this machine allows it, so that a test can skip cleanly where it does not (and
:func:`delay_available` whether a delay can be added)::

    with EmulatedHosts(hosts=2, rate_mbit=100) as net:
        subprocess.run(net.command(1, ["python", "rank.py", net.address(0)]))
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass, field

__all__ = ["INTERFACE", "EmulatedHosts", "available", "delay_available"]

INTERFACE = "eth0"
"""The name of each host's link inside its namespace (``GLOO_SOCKET_IFNAME``)."""

_counter = itertools.count()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def _probe(qdisc: list[str]) -> str | None:
    """None when a namespace can be made and given ``qdisc`` on its loopback, else why not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "emulating hosts needs root (network namespaces, tc)"
    name = f"rdprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except OSError as exc:
        return f"cannot make a network namespace: {exc}"
    try:
        done = subprocess.run(
            ["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", *qdisc],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            return f"tc qdisc {qdisc[0]} is not available: {done.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def available() -> str | None:
    """None when this machine can make network namespaces with rate-limited links, else why
    not (one line)."""
    return _probe(["tbf", "rate", "100mbit", "burst", "32kb", "latency", "100ms"])


def delay_available() -> str | None:
    """None when links can also be delayed (the kernel's ``sch_netem``), else why not."""
    return _probe(["netem", "delay", "1ms"])


@dataclass
class EmulatedHosts:
    """``hosts`` emulated hosts whose links carry ``rate_mbit`` megabits per second each way
    (None: unlimited) with ``delay_ms`` of one-way delay (as a context manager: made on entry,
    deleted on exit, also when the block raises)."""

    hosts: int
    rate_mbit: float | None = None
    delay_ms: float = 0.0
    """Needs :func:`delay_available` (the rate alone does not)."""
    subnet: int = field(default_factory=lambda: 16 + (os.getpid() + next(_counter)) % 200)
    """The third byte of the hosts' addresses (distinct per instance, so that two runs on one
    machine do not share names or addresses)."""

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise ValueError(f"hosts must be at least 1, got {self.hosts}")
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be positive, got {self.rate_mbit}")
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")
        self._prefix = f"rd{self.subnet}x{os.getpid() % 10000}"
        self._made: list[str] = []

    def namespace(self, host: int) -> str:
        """The network namespace of ``host``."""
        return f"{self._prefix}h{host}"

    def address(self, host: int) -> str:
        """The IPv4 address of ``host`` (its processes listen there)."""
        return f"10.213.{self.subnet}.{host + 1}"

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def __enter__(self) -> EmulatedHosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        switch = f"{self._prefix}sw"
        self._add_namespace(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host in range(self.hosts):
            ns, port = self.namespace(host), f"p{host}"
            self._add_namespace(ns)
            _ip("link", "add", INTERFACE, "netns", ns, "type", "veth", "peer", "name", port,
                "netns", switch)  # fmt: skip
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", INTERFACE)
            for args in (("-n", ns, "link", "set", "lo", "up"),
                         ("-n", ns, "link", "set", INTERFACE, "up"),
                         ("-n", switch, "link", "set", port, "master", "br0"),
                         ("-n", switch, "link", "set", port, "up")):  # fmt: skip
                _ip(*args)
            self._shape(ns, INTERFACE)  # what the host sends
            self._shape(switch, port)  # what it receives

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _shape(self, namespace: str, device: str) -> None:
        """The rate (a token bucket: a burst of 4 ms at the rate, at least 16 KiB, a queue of
        up to 400 ms) and, under it, the delay."""
        tc = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
        parent = ["root"]
        if self.rate_mbit is not None:
            burst = max(16 * 1024, int(self.rate_mbit * 1e6 / 8 * 0.004))
            subprocess.run(
                [*tc, "root", "handle", "1:", "tbf", "rate", f"{self.rate_mbit}mbit",
                 "burst", str(burst), "latency", "400ms"],
                check=True,
                capture_output=True,
            )  # fmt: skip
            parent = ["parent", "1:1"]
        if self.delay_ms:
            subprocess.run(
                [*tc, *parent, "netem", "delay", f"{self.delay_ms}ms", "limit", "100000"],
                check=True,
                capture_output=True,
            )

    def close(self) -> None:
        """Deletes the namespaces (their veth ends and qdiscs go with them)."""
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)
