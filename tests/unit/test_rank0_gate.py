"""Rank0Gate on a real c10d TCPStore: ranks 1..N wait for rank 0 outside any collective."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_sao.distributed.rank0_gate import Rank0Gate, Rank0Lost


def _stores():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=2), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=2))
    return master, client


def test_rank1_waits_for_each_arrival_of_rank0_longer_than_the_store_timeout():
    master, client = _stores()
    r0 = Rank0Gate(master, 0, 2, poll_s=0.05, heartbeat_s=0.2, stale_s=5.0)
    r1 = Rank0Gate(client, 1, 2, poll_s=0.05, heartbeat_s=0.2, stale_s=5.0)
    r0.start_heartbeat()
    arrived, left_first = [], threading.Event()

    def rank0():
        for gate in range(2):
            if gate:  # the second sleep starts once rank 1 is past the first gate: each wait is a full 2.5 s
                left_first.wait()
            time.sleep(2.5)  # longer than the store's own 2 s timeout: the wait never blocks in it
            arrived.append(time.monotonic())
            r0.arrive("x")

    th = threading.Thread(target=rank0)
    th.start()
    waits = [r1.arrive("the first collective")]
    left_first.set()
    waits.append(r1.arrive("the second collective"))
    done = time.monotonic()
    th.join()
    r0.close()
    assert all(w > 2.2 for w in waits), waits  # both past the store timeout (2 s)
    assert done >= arrived[1]  # rank 1 left the second gate only after rank 0's second arrival
    assert r1.arrivals == 2


def test_rank1_already_late_does_not_wait():
    master, client = _stores()
    r0, r1 = Rank0Gate(master, 0, 2), Rank0Gate(client, 1, 2)
    r0.arrive("x")
    r0.arrive("y")
    t0 = time.monotonic()
    assert r1.arrive("x") < 0.5 and r1.arrive("y") < 0.5
    assert time.monotonic() - t0 < 1.0
    r0.close()


def test_a_silent_rank0_is_reported_after_stale_s():
    master, client = _stores()
    r1 = Rank0Gate(client, 1, 2, poll_s=0.05, heartbeat_s=0.1, stale_s=1.0)  # rank 0 never beats
    t0 = time.monotonic()
    with pytest.raises(Rank0Lost, match="rank 0 sent no heartbeat for 1s while this rank waited .* the stop agreement"):
        r1.arrive("the stop agreement")
    assert 0.9 <= time.monotonic() - t0 < 5.0
    del master


def test_a_beating_rank0_keeps_rank1_waiting_past_stale_s():
    master, client = _stores()
    r0 = Rank0Gate(master, 0, 2, heartbeat_s=0.1, stale_s=0.5)
    r1 = Rank0Gate(client, 1, 2, poll_s=0.05, heartbeat_s=0.1, stale_s=0.5)
    r0.start_heartbeat()
    threading.Timer(2.0, r0.arrive, args=("x",)).start()
    assert r1.arrive("x") >= 1.9  # four times stale_s, alive all along
    r0.close()


def test_world_size_one_never_touches_a_store():
    g = Rank0Gate(None, 0, 1)
    assert g.arrive("x") == 0.0 and g.arrivals == 1


def test_bad_intervals_are_refused():
    with pytest.raises(ValueError, match="heartbeat_s < stale_s"):
        Rank0Gate(None, 0, 2, heartbeat_s=5, stale_s=1)
