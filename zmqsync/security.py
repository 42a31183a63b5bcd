"""ZeroMQ CURVE: encryption and authentication for every socket of a fleet.

The sender holds a server key pair (:class:`CurveServer`); each worker holds a client
pair and the server's public key (:class:`CurveClient`). With ``allowed_clients`` the
sender's ZAP handler accepts only those client keys. Key files are what ``zmqsync keys``
writes (:func:`create_curve_keypair`), in ``zmq.auth``'s format: ``NAME.key`` (public)
and ``NAME.key_secret`` (both keys, readable by its owner only)::

    server = curve_server_from_files("keys/server.key_secret", "keys/clients")
    client = curve_client_from_files("keys/worker.key_secret", "keys/server.key")
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from zmqsync.errors import ZMQSyncError
from zmqsync.transport.base import RELAY_CREDENTIAL

__all__ = [
    "ZAP_DOMAIN",
    "CurveClient",
    "CurveServer",
    "create_curve_keypair",
    "curve_client_from_files",
    "curve_server_from_files",
    "exposed_secret_file",
    "generate_keypair",
    "write_keypair",
]

log = logging.getLogger("zmqsync.security")

#: The ZAP domain every zmqsync server socket authenticates in.
ZAP_DOMAIN = "zmqsync"
#: Mode of a secret key file: whoever reads it can pose as its owner.
SECRET_FILE_MODE: Final = 0o600
#: Mode of a public key file: meant to be handed out, but changed by its owner only.
PUBLIC_FILE_MODE: Final = 0o644
#: Permission bits that open a secret key file to users other than its owner.
_OTHERS: Final = stat.S_IRWXG | stat.S_IRWXO
# The layout pyzmq's zmq.auth.create_certificates writes (and load_certificate reads).
_BANNER: Final = (
    "#   ****  Generated on {now} by zmqsync  ****\n"
    "#   ZeroMQ CURVE {what} Certificate\n"
    "#   {advice}\n\n"
)


def generate_keypair() -> tuple[bytes, bytes]:
    """A new (public, secret) CURVE key pair, Z85-encoded."""
    return zmq.curve_keypair()


def _certificate(public: bytes, secret: bytes | None) -> str:
    """A key file's text, as ``zmq.auth.load_certificate`` reads it."""
    if secret is None:
        what, advice = "Public", "Exchange securely, or check its contents after exchange."
    else:
        what, advice = "**Secret**", "DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its mode."
    lines = [
        _BANNER.format(now=datetime.datetime.now(), what=what, advice=advice),
        "metadata\ncurve\n",
        f'    public-key = "{public.decode()}"\n',
    ]
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"\n')
    return "".join(lines)


def _create(path: Path, text: str, mode: int, *, replace: bool) -> None:
    """Write a new file at ``path`` with ``mode`` from its creation (never chmodded after,
    so it is never readable by others even for a moment). O_EXCL: never write through an
    existing file or a planted link. ``replace``: remove what is there first, so that a
    reader holding the old file open never sees the new contents."""
    if replace:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def _key_files(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """The pair ``name``'s files in ``directory``: ``(NAME.key, NAME.key_secret)``."""
    folder = Path(directory)
    return folder / f"{name}.key", folder / f"{name}.key_secret"


def write_keypair(
    directory: str | os.PathLike[str], name: str, *, force: bool = False
) -> tuple[Path, Path]:
    """Write a new key pair: ``NAME.key`` (public, mode 0644) and ``NAME.key_secret``
    (both keys, mode 0600 from its creation), in the format ``zmq.auth`` reads.

    Raises ``FileExistsError`` if either file (or a link) is there, unless ``force``,
    which replaces them with new files. Returns ``(public_file, secret_file)``.
    """
    public_file, secret_file = _key_files(directory, name)
    public, secret = generate_keypair()
    _create(secret_file, _certificate(public, secret), SECRET_FILE_MODE, replace=force)
    _create(public_file, _certificate(public, None), PUBLIC_FILE_MODE, replace=force)
    return public_file, secret_file


def exposed_secret_file(path: str | os.PathLike[str]) -> str | None:
    """Why the secret key file at ``path`` is not private (users other than its owner may
    read or change it), or None when it is (or cannot be looked at)."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None
    if not mode & _OTHERS:
        return None
    return (
        f"CURVE secret key file {path} is open to other users (mode {mode:04o}): whoever "
        f"reads it can pose as this side; chmod 600 {path}"
    )


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
    if secret:
        exposed = exposed_secret_file(p)
        if exposed is not None:
            log.warning("%s", exposed)
    return public, secret_key


@dataclass(frozen=True)
class CurveServer:
    """The sender's side: its key pair and, optionally, the client keys it accepts and
    those of them allowed to act as relays (to claim the workers below them: see
    :data:`~zmqsync.transport.base.RELAY_CREDENTIAL`). Without ``relay_clients`` no
    client may: a relay still forwards every version, but the learner does not take
    its word for who is below it (no targeted send reaches them)."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    allowed_clients: frozenset[bytes] | None = None
    relay_clients: frozenset[bytes] = frozenset()

    @classmethod
    def from_files(
        cls,
        secret_file: str | os.PathLike[str],
        *,
        allowed_clients_dir: str | os.PathLike[str] | None = None,
        relay_clients: str | os.PathLike[str] | None = None,
    ) -> CurveServer:
        """Keys from ``zmqsync keys``' files; ``relay_clients``: a public key file, or a
        directory of them, of the clients allowed to act as relays (they are allowed
        clients too)."""
        public, secret = _load(secret_file, secret=True)
        allowed = None
        if allowed_clients_dir is not None:
            clients = Path(allowed_clients_dir)
            if not clients.is_dir():
                raise FileNotFoundError(f"allowed-clients directory {clients} does not exist")
            allowed = _public_keys(clients)
        relays = frozenset() if relay_clients is None else _public_keys(Path(relay_clients))
        if allowed is not None:
            allowed |= relays
        assert secret is not None
        return cls(public, secret, allowed, relays)

    def with_clients(self, keys: Iterable[bytes]) -> CurveServer:
        return CurveServer(self.public_key, self.secret_key, frozenset(keys), self.relay_clients)

    def with_relays(self, keys: Iterable[bytes]) -> CurveServer:
        """The same, with ``keys`` (Z85 public keys) allowed to act as relays."""
        relays = frozenset(keys)
        allowed = None if self.allowed_clients is None else self.allowed_clients | relays
        return CurveServer(self.public_key, self.secret_key, allowed, relays)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
        sock.zap_domain = ZAP_DOMAIN.encode()

    def start_authenticator(self, context: zmq.Context[Any]) -> ThreadAuthenticator:
        """The ZAP handler that accepts exactly ``allowed_clients`` (any, when None),
        and names each client by its role and key (the User-Id of its messages)."""
        auth = _Authenticator(context, self.relay_clients)
        auth.start()
        if self.allowed_clients is None:
            auth.configure_curve(domain=ZAP_DOMAIN, location=zmq.auth.CURVE_ALLOW_ANY)
        else:
            auth.configure_curve_callback(
                domain=ZAP_DOMAIN, credentials_provider=_AllowList(self.allowed_clients)
            )
        return auth


def _public_keys(path: Path) -> frozenset[bytes]:
    """The public key in a ``.key`` file, or those of every ``.key`` file in a directory."""
    if path.is_dir():
        return frozenset(_load(file, secret=False)[0] for file in sorted(path.glob("*.key")))
    if not path.is_file():
        raise FileNotFoundError(f"no CURVE public key file or directory at {path}")
    return frozenset({_load(path, secret=False)[0]})


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler, naming each CURVE client ``relay:KEY`` or ``client:KEY``:
    the role rides on every message of the connection, where no peer can forge it."""

    def __init__(self, context: zmq.Context[Any], relays: frozenset[bytes]) -> None:
        super().__init__(context, log=None)
        self._relays = relays

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = zmq.utils.z85.encode(client_public_key)
        role = RELAY_CREDENTIAL if key in self._relays else "client:"
        return role + key.decode("ascii")


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


# --- key files, as the commands take them ---------------------------------------------


def create_curve_keypair(
    directory: str | os.PathLike[str], name: str = "zmqsync", *, force: bool = False
) -> tuple[Path, Path]:
    """Write a ZeroMQ CURVE key pair: ``NAME.key`` (public) and ``NAME.key_secret``.

    The secret file is created readable by its owner only (mode 0600 from the start).
    Refuses to overwrite an existing pair unless ``force``. Returns
    ``(public_file, secret_file)``.
    """
    if not zmq.has("curve"):
        raise ZMQSyncError("this libzmq was built without CURVE support; install pyzmq's wheel")
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"key name {name!r} must be a plain file name, like 'learner'")
    public, secret = _key_files(directory, name)
    if not force and (os.path.lexists(public) or os.path.lexists(secret)):  # links too
        raise FileExistsError(
            f"{public} or {secret} already exists; pick another --name, or --force to replace"
        )
    Path(directory).mkdir(parents=True, exist_ok=True)
    return write_keypair(directory, name, force=force)


def curve_server_from_files(
    secret_file: str | os.PathLike[str] | None,
    allowed_clients_dir: str | os.PathLike[str] | None = None,
    relay_clients: str | os.PathLike[str] | None = None,
) -> CurveServer | None:
    """The sender's CURVE keys from ``zmqsync keys`` files; ``None`` without a secret file.

    ``allowed_clients_dir`` holds the public ``*.key`` files of the workers (and status
    clients) to accept; without it, any client with the server's public key may connect
    (encrypted, but not authenticated). ``relay_clients``: the public key file (or a
    directory of them) of the clients allowed to act as relays; without it, none may.
    """
    if secret_file is None:
        if allowed_clients_dir is not None or relay_clients is not None:
            raise ValueError(
                "a directory of allowed client keys needs the sender's own secret key file too"
            )
        return None
    return CurveServer.from_files(
        secret_file, allowed_clients_dir=allowed_clients_dir, relay_clients=relay_clients
    )


def curve_client_from_files(
    secret_file: str | os.PathLike[str] | None,
    server_public_file: str | os.PathLike[str] | None,
) -> CurveClient | None:
    """A client's CURVE keys (its secret file and the sender's public key file), or
    ``None`` when neither is given. One without the other is an error."""
    if secret_file is None and server_public_file is None:
        return None
    if secret_file is None or server_public_file is None:
        raise ValueError(
            "CURVE needs both this side's secret key file (NAME.key_secret) and the "
            "sender's public key file (NAME.key)"
        )
    return CurveClient.from_files(secret_file, server_public_file=server_public_file)
