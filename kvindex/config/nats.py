"""How every component connects to NATS: servers (a cluster), credentials and TLS.

One module for ``kvindex serve``, ``kvindex capture``, the ``kvshim`` bridges and simulator, the
publisher library and any later client: :func:`add_nats_arguments` adds the "NATS connection" option
group to a command, :meth:`NatsSettings.from_args` reads it back, :meth:`NatsSettings.connect_kwargs`
turns it into nats-py ``connect`` arguments and :func:`connect` connects with a clear error. The
options also come from the environment and a TOML file (kvindex/config/layers.py).

Secrets (passwords, tokens, userinfo in URLs) never leave this object except into nats-py: its
``repr`` hides them and :meth:`NatsSettings.describe` is what logs may show.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ssl
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

DEFAULT_URL = "nats://127.0.0.1:4222"


class NatsConfigError(ValueError):
    """The NATS settings cannot work (missing file, half a key pair, two auth methods...)."""


class NatsConnectError(ConnectionError):
    """NATS could not be reached or refused us; the message says which servers and why."""


def split_servers(values: Iterable[str] | str | None) -> tuple[str, ...]:
    """URLs from repeated and/or comma-separated values, in order, without duplicates."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for value in values:
        for part in value.split(","):
            url = part.strip()
            if url and "://" not in url:
                url = "nats://" + url  # host:port, as nats-py also accepts
            if url and url not in out:
                out.append(url)
    return tuple(out)


def redact_url(url: str) -> str:
    """The URL without its userinfo secret: ``nats://alice:pw@h:4222`` -> ``nats://alice:***@h:4222``,
    a token (``nats://tok@h``) -> ``nats://***@h``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, sep, _password = userinfo.partition(":")
    shown = f"{user}:***" if sep else "***"
    return urlunsplit(parts._replace(netloc=f"{shown}@{hostport}"))


@dataclass(frozen=True, repr=False)
class NatsSettings:
    """Where and how to connect. Paths are read by nats-py (creds, seed) or ssl (certificates)."""

    servers: tuple[str, ...] = (DEFAULT_URL,)
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    nkey_seed: str | None = None  # file holding a user NKey seed (SU...)
    creds: str | None = None  # a .creds file: user JWT + NKey seed (decentralized auth)
    tls_ca: str | None = None  # CA bundle that signed the servers' certificates
    tls_cert: str | None = None  # client certificate (mutual TLS) ...
    tls_key: str | None = None  # ... and its key

    def __repr__(self) -> str:  # servers may carry userinfo: redacted like every log line
        shown = {k: v for k, v in self.describe().items()}
        for name in ("user", "nkey_seed", "creds", "tls_ca", "tls_cert", "tls_key"):
            if getattr(self, name):
                shown[name] = getattr(self, name)
        return f"NatsSettings({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @classmethod
    def from_url(cls, url: str | Sequence[str]) -> NatsSettings:
        return cls(servers=split_servers(url))

    @classmethod
    def coerce(cls, value: NatsSettings | str | Sequence[str]) -> NatsSettings:
        """Accept what callers historically passed (one URL) as well as full settings."""
        return value if isinstance(value, NatsSettings) else cls.from_url(value)

    @classmethod
    def from_args(cls, args: argparse.Namespace, default: str | None = None) -> NatsSettings | None:
        """The settings of a command that called :func:`add_nats_arguments`; None when no server was
        given and the command has no default (``kvindex serve`` then embeds its own nats-server)."""
        servers = split_servers(args.nats)
        if not servers:
            fallback = default if default is not None else getattr(args, "nats_default_url", None)
            servers = split_servers(fallback)
        settings = cls(
            servers=servers,
            user=args.nats_user,
            password=args.nats_password,
            token=args.nats_token,
            nkey_seed=args.nats_nkey_seed,
            creds=args.nats_creds,
            tls_ca=args.nats_tls_ca,
            tls_cert=args.nats_tls_cert,
            tls_key=args.nats_tls_key,
        )
        if servers:
            return settings
        if settings.auth != "none" or settings.tls != "off":
            # Credentials meant for a real server must not silently go unused.
            raise NatsConfigError("NATS credentials or TLS options were given without --nats URL")
        return None

    @property
    def auth(self) -> str:
        """The authentication method, for logs: creds, nkey, token, user, url or none."""
        if self.creds:
            return "creds"
        if self.nkey_seed:
            return "nkey"
        if self.token:
            return "token"
        if self.user:
            return "user"
        if any("@" in urlsplit(u).netloc for u in self.servers):
            return "url"
        return "none"

    @property
    def tls(self) -> str:
        if self.tls_cert:
            return "mutual"
        if self.tls_ca or any(u.startswith("tls://") for u in self.servers):
            return "on"
        return "off"

    def describe(self) -> dict[str, Any]:
        """What a log line may show: redacted servers, the auth method, the TLS mode; no secret."""
        return {"servers": [redact_url(u) for u in self.servers], "auth": self.auth, "tls": self.tls}

    def redacted_servers(self) -> str:
        return ",".join(redact_url(u) for u in self.servers)

    def validate(self) -> None:
        methods = [
            name
            for name, on in (
                ("--nats-creds", self.creds),
                ("--nats-nkey-seed", self.nkey_seed),
                ("--nats-token", self.token),
                ("--nats-user", self.user),
            )
            if on
        ]
        if len(methods) > 1:
            raise NatsConfigError(f"choose one NATS authentication method, got {' and '.join(methods)}")
        if self.password and not self.user:
            raise NatsConfigError("--nats-password needs --nats-user")
        if self.user and not self.password:
            raise NatsConfigError("--nats-user needs --nats-password")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise NatsConfigError("mutual TLS needs both --nats-tls-cert and --nats-tls-key")
        for option, path in (
            ("--nats-creds", self.creds),
            ("--nats-nkey-seed", self.nkey_seed),
            ("--nats-tls-ca", self.tls_ca),
            ("--nats-tls-cert", self.tls_cert),
            ("--nats-tls-key", self.tls_key),
        ):
            if path and not Path(path).is_file():
                raise NatsConfigError(f"{option} {path}: no such file")
        for url in self.servers:
            scheme = urlsplit(url).scheme
            if scheme not in ("nats", "tls", "ws", "wss"):
                raise NatsConfigError(f"NATS URL {redact_url(url)!r}: scheme must be nats:// or tls://")

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context; None when TLS is not configured (nats-py then makes a default one
        for ``tls://`` URLs, trusting the system CAs)."""
        if not (self.tls_ca or self.tls_cert):
            return None
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except (ssl.SSLError, OSError) as exc:
            raise NatsConfigError(f"NATS TLS files unusable: {exc}") from None
        return ctx

    def connect_kwargs(self) -> dict[str, Any]:
        """Arguments for ``nats.connect`` (servers, auth, TLS), after :meth:`validate`."""
        self.validate()
        kwargs: dict[str, Any] = {"servers": list(self.servers)}
        if self.creds:
            kwargs["user_credentials"] = self.creds
        elif self.nkey_seed:
            kwargs["nkeys_seed"] = self.nkey_seed
        elif self.token:
            kwargs["token"] = self.token
        elif self.user:
            kwargs["user"], kwargs["password"] = self.user, self.password
        ctx = self.ssl_context()
        if ctx is not None:
            kwargs["tls"] = ctx
        return kwargs


async def connect(settings: NatsSettings | str | Sequence[str], *, name: str, **options: Any) -> Any:
    """``nats.connect`` with ``settings``; ``options`` are nats-py's others (callbacks, reconnects).

    Raises NatsConfigError for unusable settings and NatsConnectError (naming the redacted servers,
    the auth method and the server's reason, e.g. 'Authorization Violation') when no server accepts.
    A server that is merely unreachable is retried as nats-py's reconnect options say (forever with
    ``max_reconnect_attempts=-1``: a worker may start before NATS); refused credentials and TLS
    verification failures are permanent, so the first one ends the attempt instead of looping.
    """
    from nats.aio.client import Client

    settings = NatsSettings.coerce(settings)
    kwargs = settings.connect_kwargs()
    user_error_cb = options.pop("error_cb", None)
    nc = Client()
    fatal: list[BaseException] = []
    last: list[BaseException] = []
    attempt: asyncio.Task[None] | None = None

    async def on_error(exc: Exception) -> None:
        if attempt is not None and not attempt.done() and not fatal:
            last[:] = [exc]
            if _permanent(exc):
                fatal.append(exc)
                attempt.cancel()
        if user_error_cb is not None:
            await user_error_cb(exc)

    attempt = asyncio.ensure_future(nc.connect(name=name, error_cb=on_error, **kwargs, **options))
    try:
        await attempt
    except (Exception, asyncio.CancelledError) as exc:
        if not fatal and isinstance(exc, asyncio.CancelledError):
            with contextlib.suppress(Exception):
                await nc.close()
            raise  # our caller was cancelled
        cause = fatal[0] if fatal else (last[0] if last else exc)
        with contextlib.suppress(Exception):
            await nc.close()
        raise NatsConnectError(
            f"cannot connect to NATS at {settings.redacted_servers()} (auth {settings.auth}, "
            f"tls {settings.tls}): {_reason(cause)}"
        ) from None
    return nc


def _permanent(exc: BaseException) -> bool:
    """Refused credentials or a TLS failure: retrying the same settings cannot succeed."""
    from nats import errors

    if isinstance(exc, errors.AuthorizationError | ssl.SSLError):
        return True
    text = str(exc).lower()
    return "authorization violation" in text or "authentication" in text


def _reason(exc: BaseException) -> str:
    from nats import errors

    if isinstance(exc, errors.AuthorizationError) or "authorization violation" in str(exc).lower():
        return "the server refused the credentials (Authorization Violation)"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate verification failed ({exc.verify_message}): check --nats-tls-ca"
    if isinstance(exc, ssl.SSLError):
        return (
            f"TLS handshake failed ({exc.reason or exc}): check --nats-tls-ca/--nats-tls-cert/--nats-tls-key"
        )
    return str(exc) or type(exc).__name__


def add_nats_arguments(
    parser: argparse.ArgumentParser, default: str | None = DEFAULT_URL, url_help: str | None = None
) -> argparse._ArgumentGroup:
    """The "NATS connection" option group (and ``--config``) on a command.

    ``default``: servers when none is given (None: the command decides, e.g. an embedded server).
    Read the result back with :meth:`NatsSettings.from_args`.
    """
    from kvindex.config.layers import add_config_option

    add_config_option(parser)
    parser.set_defaults(nats_default_url=default)
    g = parser.add_argument_group(
        "NATS connection",
        "also from env KVINDEX_<OPTION> (e.g. KVINDEX_NATS_URL, KVINDEX_NATS_CREDS) or --config FILE; "
        "the command line wins, then the environment, then the file",
    )
    g.add_argument(
        "--nats",
        "--nats-url",
        dest="nats",
        action="append",
        metavar="URL",
        default=None,
        help=url_help
        or "NATS server URL(s), nats:// or tls://; repeat or comma-separate several servers of a cluster "
        f"(any of them is used and reconnected to; default {default})",
    )
    g.add_argument("--nats-user", metavar="USER", default=None, help="user name (with --nats-password)")
    g.add_argument(
        "--nats-password", metavar="PASSWORD", default=None, help="password; prefer KVINDEX_NATS_PASSWORD"
    )
    g.add_argument("--nats-token", metavar="TOKEN", default=None, help="token; prefer KVINDEX_NATS_TOKEN")
    g.add_argument("--nats-nkey-seed", metavar="FILE", default=None, help="file with the user's NKey seed")
    g.add_argument(
        "--nats-creds", metavar="FILE", default=None, help="credentials file: user JWT + NKey seed (nsc)"
    )
    g.add_argument("--nats-tls-ca", metavar="FILE", default=None, help="CA certificate(s) of the servers")
    g.add_argument("--nats-tls-cert", metavar="FILE", default=None, help="client certificate for mutual TLS")
    g.add_argument("--nats-tls-key", metavar="FILE", default=None, help="client key for mutual TLS")
    return g
