"""Ports for servers and rendezvous come from below the kernel's ephemeral range (distributed/ports.py):
a port the kernel hands out for port-0 binds and outgoing connections can be taken between our pick
and the server's bind."""

from __future__ import annotations

import socket

import pytest

from megatron_sao.distributed import ports

LINUX_DEFAULT = (32768, 60999)  # the tests name the range: this machine's own may start anywhere


def test_reads_the_kernels_range_and_falls_back_to_linuxs_default(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(f) == (40000, 50000)
    f.write_text("garbage\n")
    assert ports.ephemeral_range(f) == LINUX_DEFAULT
    assert ports.ephemeral_range(tmp_path / "missing") == LINUX_DEFAULT


def test_ports_lie_below_the_ephemeral_range_and_can_be_bound():
    low, _ = LINUX_DEFAULT
    for _ in range(50):
        p = ports.free_port_block(1, port_range=LINUX_DEFAULT)
        assert ports.LOWEST <= p < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free right after the pick


def test_a_block_is_consecutive_free_below_the_range_and_avoids_what_it_is_told():
    low, _ = LINUX_DEFAULT
    for _ in range(20):
        base = ports.free_port_block(4, port_range=LINUX_DEFAULT)
        assert ports.LOWEST <= base and base + 3 < low
        socks = [socket.socket() for _ in range(4)]
        try:
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i))
        finally:
            for s in socks:
                s.close()
    # A range with room for exactly one block: the only base left is refused, so every draw fails.
    only = (ports.LOWEST + 2,)
    with pytest.raises(RuntimeError, match="no block of 2 free consecutive ports"):
        ports.free_port_block(2, avoid=[ports.LOWEST, ports.LOWEST + 1], port_range=only + (65535,))


def test_a_port_in_use_is_never_handed_out():
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.LOWEST))
        # room for a single one-port block, ports.LOWEST, which is taken
        with pytest.raises(RuntimeError, match="no block of 1"):
            ports.free_port_block(1, port_range=(ports.LOWEST + 1, 65535))
    assert ports.free_port_block(1, port_range=(ports.LOWEST + 1, 65535)) == ports.LOWEST


def test_without_room_below_the_range_the_kernel_picks():
    p = ports.free_port_block(1, port_range=(1024, 65535))
    assert p > 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))
