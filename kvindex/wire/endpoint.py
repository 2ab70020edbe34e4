"""Where a worker serves requests: ``host:port`` as announced in its heartbeat (docs/wire.md §4).

One parser for every party (publisher, index decoder, CLI defaults, clients), so that what a worker
may announce and what the index accepts cannot drift apart. The form is deliberately narrow, the
one routers and gateways put in a ``Host`` header or Envoy's ``x-gateway-destination-endpoint``:
no scheme, no path, no user info.

- ``host`` is a DNS name (labels of ``[A-Za-z0-9-]``, 1-63 chars, not starting or ending with ``-``,
  253 chars at most, dots between labels), an IPv4 address, or an IPv6 address in brackets;
- ``port`` is 1-65535, decimal, no sign.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final
from urllib.parse import urlsplit

MAX_ENDPOINT_LEN: Final = 261  # 253 (name) + ":" + 5 (port), and room for "[v6]"
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_PORT = re.compile(r"[0-9]{1,5}")


class BadEndpoint(ValueError):
    """Not ``host:port``; the message says what is wrong."""


def parse_endpoint(text: object) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` (IPv6 host without its brackets); BadEndpoint otherwise."""
    if not isinstance(text, str):
        raise BadEndpoint(f"endpoint must be a string 'host:port', got {type(text).__name__}")
    if not text or len(text) > MAX_ENDPOINT_LEN:
        raise BadEndpoint(f"endpoint must be 1-{MAX_ENDPOINT_LEN} characters 'host:port', got {len(text)}")
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise BadEndpoint(f"endpoint {text!r}: an IPv6 host must be written '[addr]:port'")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise BadEndpoint(f"endpoint {text!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise BadEndpoint(f"endpoint {text!r} is not 'host:port'")
        if not _valid_host(host):
            raise BadEndpoint(
                f"endpoint {text!r}: host {host!r} is not a DNS name or IPv4 address "
                "(no scheme or path; IPv6 in brackets)"
            )
    if not (_PORT.fullmatch(port) and 1 <= int(port) <= 65535):
        raise BadEndpoint(f"endpoint {text!r}: port {port!r} is not a number in 1-65535")
    return host, int(port)


def _valid_host(host: str) -> bool:
    if len(host) > 253:
        return False
    labels = host.split(".")
    if all(label.isdigit() for label in labels):  # looks numeric: must be a real IPv4 address
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return True
    return all(_LABEL.fullmatch(label) for label in labels)


def check_endpoint(text: str) -> str:
    """``text`` itself when it is a valid endpoint (BadEndpoint otherwise): for configuration."""
    parse_endpoint(text)
    return text


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def endpoint_from_url(url: str) -> str:
    """``host:port`` of an http(s) URL (the port defaults to the scheme's), e.g. an engine's
    ``--metrics-url``: a worker's API and metrics share one server in vLLM, SGLang and TRT-LLM."""
    parts = urlsplit(url if "//" in url else f"http://{url}")
    if not parts.hostname:
        raise BadEndpoint(f"URL {url!r} names no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise BadEndpoint(f"URL {url!r}: {exc}") from None
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    return check_endpoint(format_endpoint(parts.hostname, port))
