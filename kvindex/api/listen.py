"""The addresses the service listens on: parsing ``HOST:PORT``, saying what is bound and who can reach
it, and the one error every listener raises when its address cannot be bound."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

__all__ = [
    "ROUTE_FIX",
    "ListenError",
    "address",
    "bind_error",
    "connect_host",
    "is_loopback",
    "is_wildcard",
    "parse_listen",
    "reachable_host",
    "route_exposure",
    "warn_unprotected",
]

_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})


class ListenError(OSError):
    """A listener could not bind its address (the port is taken, the host is not this machine's).
    ``what`` names the listener (``gRPC``, ``metrics``, ``ext_proc``, ``embedded NATS``) so the command
    line can name its flag."""

    def __init__(self, what: str, where: str, reason: str) -> None:
        super().__init__(f"cannot listen on {where} for {what}: {reason}")
        self.what = what
        self.where = where
        self.reason = reason


def is_wildcard(host: str) -> bool:
    return host in _WILDCARDS


def is_loopback(host: str) -> bool:
    """Only this machine can connect (a name other than ``localhost`` is taken as reachable)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def connect_host(host: str) -> str:
    """Where a client on this machine connects to a listener bound on ``host``."""
    if host in ("::", "[::]"):
        return "::1"
    return "127.0.0.1" if is_wildcard(host) else host


def address(host: str, port: int) -> str:
    """``host:port``, IPv6 hosts bracketed."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now, in the OS's words (``Address already in use``), or None.

    Asked before a server whose own failure says less: gRPC only returns "no port" and its C core
    writes an ``E... add_port.cc`` line of its own to stderr, ahead of our error. Binds like gRPC
    (SO_REUSEADDR, no SO_REUSEPORT; a wildcard is 0.0.0.0 or dual-stack ``::``; a name is fine when
    one of its addresses binds). Port 0 always binds. Another program can still take the port
    between this check and the real bind: the server's own failure then says so, as before.
    """
    if port == 0:
        return None
    bare = host.strip("[]")
    candidates: list[tuple[int, tuple[Any, ...]]]
    if bare == "::":
        candidates = [(socket.AF_INET6, ("::", port))]
    elif is_wildcard(host):
        candidates = [(socket.AF_INET, ("0.0.0.0", port))]
    else:
        try:
            infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except (socket.gaierror, UnicodeError) as exc:
            return f"cannot resolve {bare!r} ({exc})"
        candidates = [(family, sockaddr[:2]) for family, _type, _proto, _name, sockaddr in infos]
    reason = None
    for family, sockaddr in candidates:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                reason = reason or exc.strerror or str(exc)
                continue
        return None
    return reason


def reachable_host(host: str) -> str:
    """The name other machines use for a listener bound on ``host``: this machine's host name for a
    wildcard (what it resolves to on their side is their DNS's business)."""
    return socket.gethostname() if is_wildcard(host) else host


def route_exposure(host: str, port: int) -> str | None:
    """The routing proxy's entry in the ``serving_without_protection`` warning (None on loopback): it
    speaks plain HTTP with no authentication, so whoever reaches it sends requests to the engines."""
    if is_loopback(host):
        return None
    return f"route {address(host, port)} (plain HTTP, no authentication: anyone can send requests)"


ROUTE_FIX = "the routing proxy: bind 127.0.0.1 for clients on this machine, else keep it behind a gateway"


def warn_unprotected(log: Any, listeners: list[str], fix: str) -> None:
    """The one ``serving_without_protection`` warning (``kvindex serve``, ``kvindex route``), naming
    every listener other machines can reach without TLS or authentication, and what to do: the start
    log says where they listen, this says what that means."""
    if listeners:
        log.warning("serving_without_protection", listeners=listeners, fix=fix)


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT``; port 0: any free port) -> (host, port); ValueError says what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r}: expected HOST:PORT, e.g. 0.0.0.0:4222 (port 0: any free port)")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"{text!r}: port {port!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"{text!r}: port {number} is not in 0-65535")
    return host.strip("[]"), number
