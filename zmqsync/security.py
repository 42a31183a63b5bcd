"""ZeroMQ CURVE: encryption and authentication for every socket of a fleet.

The sender holds a server key pair; each worker holds a client key pair and the server's
public key. With ``allowed_clients`` the sender accepts only those client public keys
(checked by a ZAP handler): anyone else can neither receive weights nor send acks or
status requests. Key files are the ones ``zmqsync keys`` (``zmq.auth.create_certificates``)
writes: ``NAME.key`` (public) and ``NAME.key_secret`` (both keys).

::

    server = CurveServer.from_files("keys/server.key_secret", allowed_clients_dir="keys/clients")
    client = CurveClient.from_files("keys/worker.key_secret", server_public_file="keys/server.key")
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["ZAP_DOMAIN", "CurveClient", "CurveServer", "generate_keypair"]

#: The ZAP domain every zmqsync server socket authenticates in.
ZAP_DOMAIN = "zmqsync"


def generate_keypair() -> tuple[bytes, bytes]:
    """A new (public, secret) CURVE key pair, Z85-encoded."""
    return zmq.curve_keypair()


def _load(path: str | os.PathLike[str], *, secret: bool) -> tuple[bytes, bytes | None]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"CURVE key file {p} does not exist; create keys with `zmqsync keys DIR`"
        )
    try:
        public, secret_key = zmq.auth.load_certificate(p)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{p} is not a ZeroMQ certificate file: {exc}") from exc
    if secret and not secret_key:
        raise ValueError(f"{p} holds no secret key; pass the NAME.key_secret file")
    return public, secret_key


@dataclass(frozen=True)
class CurveServer:
    """The sender's side: its key pair and, optionally, the client keys it accepts."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    allowed_clients: frozenset[bytes] | None = None

    @classmethod
    def from_files(
        cls,
        secret_file: str | os.PathLike[str],
        *,
        allowed_clients_dir: str | os.PathLike[str] | None = None,
    ) -> CurveServer:
        public, secret = _load(secret_file, secret=True)
        allowed = None
        if allowed_clients_dir is not None:
            d = Path(allowed_clients_dir)
            if not d.is_dir():
                raise FileNotFoundError(f"allowed-clients directory {d} does not exist")
            allowed = frozenset(_load(f, secret=False)[0] for f in sorted(d.glob("*.key")))
        assert secret is not None
        return cls(public, secret, allowed)

    def with_clients(self, keys: Iterable[bytes]) -> CurveServer:
        return CurveServer(self.public_key, self.secret_key, frozenset(keys))

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
        sock.zap_domain = ZAP_DOMAIN.encode()

    def start_authenticator(self, context: zmq.Context[Any]) -> ThreadAuthenticator:
        """The ZAP handler that accepts exactly ``allowed_clients`` (any, when None)."""
        auth = ThreadAuthenticator(context, log=None)
        auth.start()
        if self.allowed_clients is None:
            auth.configure_curve(domain=ZAP_DOMAIN, location=zmq.auth.CURVE_ALLOW_ANY)
        else:
            auth.configure_curve_callback(
                domain=ZAP_DOMAIN, credentials_provider=_AllowList(self.allowed_clients)
            )
        return auth


class _AllowList:
    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


@dataclass(frozen=True)
class CurveClient:
    """A worker's side: its key pair and the sender's public key."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    server_key: bytes

    @classmethod
    def from_files(
        cls, secret_file: str | os.PathLike[str], *, server_public_file: str | os.PathLike[str]
    ) -> CurveClient:
        public, secret = _load(secret_file, secret=True)
        server, _ = _load(server_public_file, secret=False)
        assert secret is not None
        return cls(public, secret, server)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_serverkey = self.server_key
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
