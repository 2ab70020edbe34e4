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
