"""The in-process restart's two stores get ports every rank agrees on: under a launcher, free
ports rank 0 picked and handed over through the launcher's own (real) TCP store, never
MASTER_PORT+2, which a CI run found held by another job's connection."""

from __future__ import annotations

import datetime
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from pretrain.resilience.inprocess import _store_ports

TIMEOUT = datetime.timedelta(seconds=20)


@pytest.fixture
def launcher_store(monkeypatch: pytest.MonkeyPatch) -> dist.TCPStore:
    """A store standing in for torchrun's agent store, with the env torchrun gives its ranks."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    return store


def test_under_a_launcher_every_rank_gets_the_free_ports_rank_0_picked(launcher_store: dist.TCPStore) -> None:
    with ThreadPoolExecutor(2) as pool:
        follower = pool.submit(_store_ports, None, "127.0.0.1", 1, TIMEOUT)  # waits for rank 0
        leader = pool.submit(_store_ports, None, "127.0.0.1", 0, TIMEOUT)
        ports = leader.result(timeout=30)
        assert follower.result(timeout=30) == ports
    assert ports[0] != ports[1]
    for port in ports:  # free: a store can listen there
        with socket.socket() as sock:
            sock.bind(("", port))
    assert launcher_store.get("pretrain/inprocess-ports/3").decode() == f"{ports[0]} {ports[1]}"


def test_a_configured_port_wins_and_without_a_launcher_store_master_port_plus_2(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert _store_ports(31000, "127.0.0.1", 1, TIMEOUT) == (31000, 31001)
    assert _store_ports(None, "127.0.0.1", 1, TIMEOUT) == (29502, 29503)
