"""Test support for secured NATS: NKeys, decentralized-auth JWTs and .creds files, made at test time.

What ``nsc`` would produce for an operator, an account and its users, written with the ``nkeys``
package (Ed25519 NKeys) and the JWT layout of nats-io/jwt v2: base64url(header).base64url(claims)
signed by the issuer's NKey. A nats-server configured with the operator JWT and the account in a
memory resolver then authenticates users by their .creds file exactly as in production.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys


@dataclass(frozen=True)
class NKey:
    seed: bytes  # SO.../SA.../SU...
    public: str  # O.../A.../U...

    def sign(self, data: bytes) -> bytes:
        return nkeys.from_seed(bytearray(self.seed)).sign(data)


def new_nkey(kind: str) -> NKey:
    """A fresh NKey pair; ``kind`` is operator, account or user."""
    prefix = {
        "operator": nkeys.PREFIX_BYTE_OPERATOR,
        "account": nkeys.PREFIX_BYTE_ACCOUNT,
        "user": nkeys.PREFIX_BYTE_USER,
    }[kind]
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    return NKey(seed, public)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def encode_jwt(issuer: NKey, subject: str, name: str, nats: dict[str, Any]) -> str:
    """A NATS v2 JWT for ``subject`` signed by ``issuer``."""
    header = {"typ": "JWT", "alg": "ed25519-nkey"}
    claims: dict[str, Any] = {
        "jti": "",
        "iat": int(time.time()),
        "iss": issuer.public,
        "name": name,
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    # The id is the hash of the claims without it, as nats-io/jwt computes it.
    digest = hashlib.new("sha512_256", json.dumps(claims, separators=(",", ":")).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{signing_input}.{_b64(issuer.sign(signing_input.encode()))}"


_UNLIMITED = {
    "subs": -1,
    "data": -1,
    "payload": -1,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
}


@dataclass
class Operator:
    """An operator with one account; :meth:`user_creds` writes users' .creds files."""

    operator: NKey
    account: NKey
    operator_jwt: str
    account_jwt: str

    @classmethod
    def create(cls) -> Operator:
        op = new_nkey("operator")
        acc = new_nkey("account")
        op_jwt = encode_jwt(op, op.public, "kvindex-test-operator", {"type": "operator"})
        acc_jwt = encode_jwt(
            op,
            acc.public,
            "KVINDEX",
            {"type": "account", "limits": _UNLIMITED, "default_permissions": {"pub": {}, "sub": {}}},
        )
        return cls(op, acc, op_jwt, acc_jwt)

    def server_config(self) -> str:
        """nats-server configuration lines for operator mode with a preloaded memory resolver."""
        return (
            f'operator: "{self.operator_jwt}"\n'
            "resolver: MEMORY\n"
            f'resolver_preload: {{ {self.account.public}: "{self.account_jwt}" }}\n'
        )

    def user_creds(
        self, path: Path, name: str, pub: list[str] | None = None, sub: list[str] | None = None
    ) -> Path:
        """Write a .creds file for a new user of the account (optionally allowed only ``pub``/``sub``)."""
        user = new_nkey("user")
        claims: dict[str, Any] = {"type": "user", "subs": -1, "data": -1, "payload": -1}
        claims["pub"] = {"allow": pub} if pub is not None else {}
        claims["sub"] = {"allow": sub} if sub is not None else {}
        token = encode_jwt(self.account, user.public, name, claims)
        path.write_text(
            "-----BEGIN NATS USER JWT-----\n"
            f"{token}\n"
            "------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            "-----BEGIN USER NKEY SEED-----\n"
            f"{user.seed.decode()}\n"
            "------END USER NKEY SEED------\n"
        )
        path.chmod(0o600)
        return path


@dataclass
class TlsFiles:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, as PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here: trusting it must fail


def make_tls_files(directory: Path) -> TlsFiles:
    import trustme  # dev dependency

    ca = trustme.CA()
    other = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("kvindex-client@example.test")
    files = TlsFiles(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
        other_ca=directory / "other-ca.pem",
    )
    ca.cert_pem.write_to_path(str(files.ca))
    other.cert_pem.write_to_path(str(files.other_ca))
    server.cert_chain_pems[0].write_to_path(str(files.server_cert))
    server.private_key_pem.write_to_path(str(files.server_key))
    client.cert_chain_pems[0].write_to_path(str(files.client_cert))
    client.private_key_pem.write_to_path(str(files.client_key))
    return files
