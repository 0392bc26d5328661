"""Which network interface gloo binds to: GLOO_SOCKET_IFNAME beside NCCL_SOCKET_IFNAME.

megatron-core creates gloo groups (the *_GLOO data-parallel groups), and gloo picks its interface
differently from NCCL: without GLOO_SOCKET_IFNAME it binds to the address the host name resolves
to, which on many clusters is 127.0.1.1 or a management network, and a multi-node job then hangs
or times out creating its first gloo group. GLOO_SOCKET_IFNAME takes exact interface names (comma
separated), not NCCL's `^lo,docker` exclusions or name prefixes.

Order: an explicit GLOO_SOCKET_IFNAME; else NCCL_SOCKET_IFNAME when it lists interface names
(`ib0`, `=bond0,eth1`); else, on the node itself, the interface that routes to MASTER_ADDR
(`interface_for`), which `init_parallel` sets before the process group exists.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from typing import Mapping

GLOO = "GLOO_SOCKET_IFNAME"
NCCL = "NCCL_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


def gloo_ifname_from_env(environ: Mapping[str, str]) -> str | None:
    """GLOO_SOCKET_IFNAME as set, or NCCL_SOCKET_IFNAME's interface names; None if neither names any."""
    if environ.get(GLOO):
        return environ[GLOO]
    nccl = environ.get(NCCL, "").strip()
    if not nccl or nccl.startswith("^"):
        return None  # exclusions say nothing about which interface to use
    names = [n.strip().lstrip("=") for n in nccl.split(",") if n.strip()]
    return ",".join(names) or None


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_for(address: str) -> str | None:
    """Name of this host's interface that the kernel routes `address` through (Linux, IPv4); None if unknown."""
    try:
        target = socket.gethostbyname(address)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # UDP connect: picks the route, sends nothing
            local = s.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name
    return None
