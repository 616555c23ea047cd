"""The host names a server answers for: its defence against DNS rebinding.

(No heavy imports: the command line reads it before it decides to serve; the check itself
is server/host_check.py's middleware.)

A web page the operator visits can make its own host name resolve to 127.0.0.1 (DNS
rebinding); the browser then treats the server as that page's origin and lets its scripts
read the answers of a server without keys: the cache views (other clients' prompts, with
--expose-cache-tokens), the metrics, the model's output, a flush. A server listening on a
loopback address (the default) is reached by every legitimate client under a loopback name,
so it answers only requests whose Host header names a loopback host (`localhost` and its
subdomains, 127.0.0.0/8, ::1) or a name given with --allowed-hosts. One listening on another
address is reached under names it cannot know: it checks none unless --allowed-hosts names
them.
"""

from __future__ import annotations

import ipaddress
import socket

ANY_HOST = "*"  # --allowed-hosts' value that turns the check off


def host_names(listen_host: str, allowed: list[str] | None) -> frozenset[str] | None:
    """The extra names a server listening on `listen_host` answers for beside the loopback
    ones, in `requested_host`'s form (a port given with one is dropped: any port matches), or
    None where it answers any (no --allowed-hosts and a listening address that is not
    loopback, or `*` among them)."""
    names = {requested_host(name) for name in allowed or ()}
    if ANY_HOST in names or (not names and not is_loopback(requested_host(listen_host))):
        return None
    return frozenset(name for name in names if name)


def requested_host(header: str) -> str | None:
    """The host of a Host header's value in one form: lower-cased, without its port, brackets
    or final dot, an IP address as Python writes it ("[::1]:8000" -> "::1", "Example.COM.:80"
    -> "example.com", "[FE80::0001]" -> "fe80::1"); None for a value that is no host[:port]."""
    value = header.strip().lower()
    if value.startswith("["):
        address, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None  # "[::1]evil.example": junk after the address
        value = address
    else:
        name, colon, port = value.rpartition(":")
        if colon and ":" not in name:  # (a bare IPv6 address has more than one colon)
            if not (name and port.isdigit()):
                return None
            value = name
        value = value.removesuffix(".")
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return value


def is_loopback(host: str | None) -> bool:
    """Whether `host` (`requested_host`'s form) always means this machine: `localhost` and its
    subdomains (RFC 6761), 127.0.0.0/8 in any form an IPv4 parser takes ("127.1", as curl
    sends it; a browser writes 127.0.0.1), ::1, and IPv4-mapped ::ffff:127.x."""
    if host is None:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:  # inet_aton's shorthand forms: "127.1", "0x7f.1", "2130706433"
            return ipaddress.IPv4Address(socket.inet_aton(host)).is_loopback
        except OSError:
            return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)
