"""Free TCP ports for rendezvous and servers, picked below the kernel's ephemeral range.

Binding port 0 asks the kernel for a port from its ephemeral range (`ip_local_port_range`,
32768-60999 on Linux by default), the same range it hands to every outgoing connection and to
every other program that binds port 0 (vLLM's internal ports, torch's stores). Between our
release of such a port and the server's bind, any of those can take it ("Address already in
use"). A port below that range is only ever taken by an explicit bind, so the window is left to
two pickers drawing the same port at random, which the bind check then catches.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below this live the well-known and registered services' ports
TRIES = 200
_rng = random.SystemRandom()  # not the process' `random` state: seeded runs would all draw the same port


def ephemeral_range(path: Path = PORT_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (low, high), or Linux's default where it cannot be read."""
    try:
        low, high = (int(x) for x in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port_block(n: int = 1, host: str = "127.0.0.1", avoid: tuple[int, ...] | list[int] = (),
                    port_range: tuple[int, int] | None = None) -> int:
    """The first of ``n`` consecutive ports free right now on ``host`` (outside ``avoid``), drawn at
    random below the ephemeral range; where that range leaves no room below it, from the kernel."""
    n = max(n, 1)
    low, _ = port_range or ephemeral_range()
    room = low - LOWEST - n + 1  # bases whose block ends below `low`
    for _ in range(TRIES):
        base = LOWEST + _rng.randrange(room) if room > 0 else _kernel_port(host)
        block = range(base, base + n)
        if block[-1] > 65535 or any(p in avoid for p in block):
            continue
        if all(_can_bind(host, p) for p in block):
            return base
    raise RuntimeError(f"no block of {n} free consecutive ports on {host} in {TRIES} draws")


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port free right now on ``host`` (see the module: below the ephemeral range)."""
    return free_port_block(1, host)
