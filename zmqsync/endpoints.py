"""Endpoint addresses: parsing them, deriving a hub's other addresses, and telling
which ones other hosts can reach.

Pure string work on ``tcp://HOST:PORT``, ``ipc:///PATH`` and ``inproc://NAME``; the
transports, the status client and the CLI all check addresses here.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Final

from zmqsync.errors import EndpointError

__all__ = [
    "check_connectable",
    "connect_address",
    "default_endpoint",
    "derive_endpoint",
    "is_loopback",
    "parse_endpoint",
    "reachable_from_other_hosts",
]

#: Longest ipc path accepted: the kernel caps a unix socket's path (108 bytes on Linux,
#: 104 on macOS), and a hub's other sockets add a suffix to it.
MAX_IPC_PATH_BYTES: Final = 100
MAX_PORT: Final = 65535
#: Mode of the directory a default ipc endpoint lives in: this user's only.
PRIVATE_DIR_MODE: Final = 0o700
_TCP_ENDPOINT: Final = re.compile(r"^tcp://(?P<host>\[[^\]]+\]|[^:/\[\]]+):(?P<port>\d+|\*)$")


def parse_endpoint(endpoint: str) -> tuple[str, str]:
    """Split ``scheme://address`` and check it is one ZeroMQ can use.

    >>> parse_endpoint("tcp://127.0.0.1:5555")
    ('tcp', '127.0.0.1:5555')
    """
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise EndpointError(
            f"endpoint {endpoint!r} is not an address; use tcp://HOST:PORT, ipc:///PATH "
            "or inproc://NAME"
        )
    scheme, _, rest = endpoint.partition("://")
    if scheme == "tcp":
        match = _TCP_ENDPOINT.match(endpoint)
        if not match or (match["port"] != "*" and not 0 <= int(match["port"]) <= MAX_PORT):
            raise EndpointError(
                f"tcp endpoint {endpoint!r} needs a host and a port: tcp://127.0.0.1:5555, "
                "or tcp://127.0.0.1:* for any free port"
            )
    elif scheme == "ipc":
        if not rest or len(rest.encode()) > MAX_IPC_PATH_BYTES:
            raise EndpointError(
                f"ipc endpoint {endpoint!r} needs a path of at most {MAX_IPC_PATH_BYTES} "
                "bytes (the kernel's limit for unix sockets)"
            )
    elif scheme == "inproc":
        if not rest:
            raise EndpointError(f"inproc endpoint {endpoint!r} needs a name: inproc://NAME")
    else:
        raise EndpointError(
            f"endpoint scheme {scheme!r} is not supported by ZeroMQ transports; "
            "use tcp://, ipc:// or inproc://"
        )
    return scheme, rest


def derive_endpoint(endpoint: str, suffix: str, port_offset: int) -> str:
    """The address of a hub's second or third socket, next to its main endpoint.

    ipc and inproc get a suffix; tcp gets the next ports, or any free port when the main
    one was chosen freely (the real address then travels in the Welcome).
    """
    scheme, _ = parse_endpoint(endpoint)
    if scheme == "tcp":
        match = _TCP_ENDPOINT.match(endpoint)
        assert match is not None
        port = match["port"]
        new_port = "*" if port in ("*", "0") else str(int(port) + port_offset)
        return f"tcp://{match['host']}:{new_port}"
    return f"{endpoint}-{suffix}"


def default_endpoint() -> tuple[str, str]:
    """A fresh ipc endpoint in a private temp dir: ``(endpoint, dir_to_remove)``."""
    tmp = tempfile.mkdtemp(prefix="zmqsync-")
    os.chmod(tmp, PRIVATE_DIR_MODE)
    return f"ipc://{tmp}/hub", tmp


def is_loopback(endpoint: str) -> bool:
    """True for ipc/inproc and tcp on 127.x / ::1 / localhost."""
    scheme, rest = parse_endpoint(endpoint)
    if scheme != "tcp":
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def connect_address(announced: str, main_endpoint: str) -> str:
    """Where a spoke connects for an address its hub announced.

    A hub bound on a wildcard host (``0.0.0.0``, ``*``) announces that; the spoke
    connects to the host it already reached the hub on instead.
    """
    match = _TCP_ENDPOINT.match(announced)
    if not match or match["host"] not in ("0.0.0.0", "*", "[::]", "[::0]"):
        return announced
    main = _TCP_ENDPOINT.match(main_endpoint)
    if main is None:
        return announced
    return f"tcp://{main['host']}:{match['port']}"


def check_connectable(endpoint: str) -> None:
    """Raise :class:`EndpointError` unless ``endpoint`` is an address one can connect to."""
    scheme, rest = parse_endpoint(endpoint)
    if scheme == "tcp" and rest.rsplit(":", 1)[1] in ("*", "0"):
        raise EndpointError(
            f"{endpoint} means 'any free port', which only a sender can bind; give the "
            "endpoint the sender printed when it started (tcp://HOST:PORT)"
        )


def reachable_from_other_hosts(endpoint: str) -> bool:
    """True for a tcp endpoint on an address other than loopback (127.x, ::1, localhost)."""
    return not is_loopback(endpoint)
