"""The ports the tests and tools hand to the servers they start."""

import socket

import pytest
import serving

from kvstore.bench.ports import free_ports


def test_the_kernel_picks_are_distinct_and_free():
    ports = free_ports(16)
    assert len(set(ports)) == 16
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_worker_picks_from_its_own_range_past_ports_in_use(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    low = serving.PORTS_BASE + 3 * serving.PORTS_PER_WORKER
    span = range(low, low + serving.PORTS_PER_WORKER)
    first = serving.free_ports(2)
    assert first[0] != first[1] and all(p in span for p in first)
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", first[1] + 1))  # the next one the worker would pick
        except OSError:
            pytest.skip(f"port {first[1] + 1} is in use here")
        taken.listen()
        later = serving.free_ports(4)
    assert first[1] + 1 not in later and all(p in span for p in later)
    assert len(set(first + later)) == 6


def test_outside_a_worker_the_kernel_picks(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    ports = serving.free_ports(2)
    assert ports[0] != ports[1]
    try:  # Linux: the kernel's range, which the workers' ranges stay below
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except OSError:
        return
    assert all(low <= p <= high for p in ports)
    assert serving.PORTS_BASE + serving.MAX_WORKERS * serving.PORTS_PER_WORKER <= low
