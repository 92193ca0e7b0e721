"""The emulated hosts of ``raydlrm._netem``: traffic between hosts runs at the set rate, inside
a host at loopback speed; the namespaces are gone afterwards. Skipped where the machine does
not allow network namespaces (not root, no iproute2)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from raydlrm._netem import EmulatedHosts, available, delay_available

REASON = available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

RECEIVE = """
import socket, sys, time
server = socket.socket()
server.bind((sys.argv[1], 5001))
server.listen(1)
print("ready", flush=True)
conn, _ = server.accept()
total, start = 0, None
while True:
    chunk = conn.recv(1 << 16)
    if not chunk:
        break
    start = start or time.perf_counter()
    total += len(chunk)
print(total, time.perf_counter() - start, flush=True)
"""

SEND = """
import socket, sys
conn = socket.create_connection((sys.argv[1], 5001))
conn.sendall(b"x" * int(sys.argv[2]))
conn.close()
"""


def _throughput(net: EmulatedHosts, *, sender: int, receiver: int, size: int) -> float:
    """Megabits per second of ``size`` bytes sent from host ``sender`` to host ``receiver``."""
    address = net.address(receiver)
    listener = subprocess.Popen(
        net.command(receiver, [sys.executable, "-c", RECEIVE, address]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout.readline().strip() == "ready"
        subprocess.run(
            net.command(sender, [sys.executable, "-c", SEND, address, str(size)]),
            check=True,
            timeout=60,
        )
        total, seconds = listener.stdout.readline().split()
    finally:
        listener.kill()
        listener.wait()
    assert int(total) == size
    return size * 8 / float(seconds) / 1e6


def test_hosts_talk_at_the_set_rate_and_inside_a_host_at_loopback_speed() -> None:
    delay = 1.0 if delay_available() is None else 0.0
    with EmulatedHosts(hosts=2, rate_mbit=80, delay_ms=delay) as net:
        namespaces = [net.namespace(0), net.namespace(1)]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(ns in listed for ns in namespaces)
        across = _throughput(net, sender=0, receiver=1, size=4_000_000)
        inside = _throughput(net, sender=0, receiver=0, size=40_000_000)
        ping = subprocess.run(
            net.command(0, ["ping", "-c", "3", "-i", "0.2", net.address(1)]),
            capture_output=True,
            text=True,
        )
    assert 0.6 * 80 < across < 1.15 * 80, across
    assert inside > 10 * across, (inside, across)
    if delay and ping.returncode == 0:  # ping may be missing; a round trip: 4 delayed ends
        rtt = float(ping.stdout.rsplit("=", 1)[1].split("/")[1])
        assert rtt >= 3.5, ping.stdout
    time.sleep(0.1)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="rate_mbit must be positive"):
        EmulatedHosts(hosts=2, rate_mbit=0)
    with pytest.raises(ValueError, match="hosts must be at least 1"):
        EmulatedHosts(hosts=0)
