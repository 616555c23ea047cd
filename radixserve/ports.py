"""TCP ports for the servers and process groups radixserve starts itself.

A port that is probed free and only bound later can be taken in between. The kernel hands out
ports from its ephemeral range to every socket bound to port 0 and to every outgoing
connection, and Ray picks its own agents' ports at random above one such port; a port asked of
the kernel that way is exactly where those land. `free_port` therefore picks below the
ephemeral range (and above Ray's default worker ports), where nothing is handed out unasked.
`bind_socket` takes the operator's port before anything slow (loading a model, starting Ray,
which picks its agents' ports at random) and holds it bound until the server listens on it.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

# Ray's workers take 10002-19999 by default; Linux's ephemeral range starts at 32768 by default.
_LOWEST = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now and outside the kernel's ephemeral range when that
    leaves room (else whatever port the kernel gives)."""
    highest = _ephemeral_low() - 1
    if highest - _LOWEST >= 1000:
        for _ in range(_TRIES):
            port = random.randint(_LOWEST, highest)
            if _bindable(host, port):
                return port
    with socket.socket(_family(host)) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening), as uvicorn and Ray Serve's proxy bind it;
    raises OSError when the port is in use. Held while a server loads (or Ray starts), it keeps
    the port from a plain bind, as Ray's probe for a free port makes, and from the kernel's
    choices; not from a process that binds it with SO_REUSEADDR too and listens (a held socket
    is not listening). SO_REUSEADDR: a port left in TIME_WAIT by the last run is not "in use"."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def cannot_listen(host: str, port: int, error: OSError) -> str:
    """The one-line error for a port that `bind_socket` could not take (the hint of a port in
    use only where it is: not for a host that does not resolve or is not this machine's)."""
    hint = f" (is another server using port {port}?)" if error.errno == errno.EADDRINUSE else ""
    return f"error: cannot listen on {host}:{port}: {error.strerror or error}{hint}"


def listen_host(text: str) -> str:
    """--host's value: an IPv6 literal may come in brackets as in a URL ([::1]); bind wants it bare."""
    return text[1:-1] if text.startswith("[") and text.endswith("]") else text


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bindable(host: str, port: int) -> bool:
    with socket.socket(_family(host)) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768, Linux's default, elsewhere)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def url_host(host: str) -> str:
    """`host` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host
