"""Free loopback ports for servers a test starts in another process (torchrun's rendezvous,
emulators): chosen below the kernel's ephemeral range, where no outgoing connection (gloo's mesh,
an HTTP client) is handed a port, so the one chosen is not taken before the server binds it.

`bind(("127.0.0.1", 0))` returns an ephemeral port: on a busy machine another process's
connection can take it between the check and the server's bind (EADDRINUSE, seen in CI)."""

from __future__ import annotations

import errno
import random
import socket

#: Used when the kernel's range cannot be read (Linux's default lower bound).
_EPHEMERAL_LOW = 32768
#: The lowest port chosen: above the well-known and most registered service ports.
_LOWEST = 15000
#: TCP messages that mean a chosen port was taken before its server bound it.
ADDRESS_IN_USE = ("EADDRINUSE", "address already in use", "Address already in use")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW


def free_port() -> int:
    """A loopback port nothing listens on, below the ephemeral range when there is room."""
    high = _ephemeral_low() - 1
    if high - _LOWEST < 1000:  # a kernel that hands out (almost) every port: take the kernel's
        return _bound_port(0)
    for _ in range(200):
        port = random.randint(_LOWEST, high)
        try:
            return _bound_port(port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
    return _bound_port(0)


def _bound_port(port: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
        return s.getsockname()[1]


def address_in_use(text: str) -> bool:
    """Whether a launcher's output says its rendezvous port was taken (then launch again)."""
    return any(marker in text for marker in ADDRESS_IN_USE)
