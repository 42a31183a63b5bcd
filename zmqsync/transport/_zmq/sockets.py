"""ZeroMQ sockets as the adapters use them: options, lean sends and receives, polling
with a wake-up, binding, and ZeroMQ's errors translated at the adapter edge.

Every hub binds a ROUTER on the endpoint the user gave (requests in, addressed messages
out) and a PULL for acks; the pub/sub hub adds a PUB for fan-out. Every spoke connects a
DEALER to the ROUTER, a PUSH to the PULL and, for pub/sub, a SUB to the PUB. Spokes learn
the data and ack addresses from the hub's Welcome, so a user names one endpoint.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final, cast

import zmq

from zmqsync.errors import TransportClosed, TransportError
from zmqsync.protocol import Buffer
from zmqsync.security import CurveClient, CurveServer

__all__ = [
    "CONTROL_MAX_MESSAGE",
    "DATA_HWM",
    "HANDSHAKE_SECONDS",
    "SPOKE_PREFIX",
    "Sockets",
    "bind",
    "frame_buffers",
    "readable",
    "recv_parts",
    "send_parts",
    "translated",
]

#: Prefix of every spoke's routing id: lets a router hub tell workers from CLI clients.
SPOKE_PREFIX: Final = b"zmqsync-spoke:"
#: Queued messages per peer before ZeroMQ drops new ones. A sender keeps at most
#: WINDOW (4) chunks unsent at once, but ZeroMQ counts a peer's queue lazily (it learns
#: of messages taken off it in batches of half the mark), and control replies queue
#: too: at 16 a peer that kept up still lost chunks now and then, at 32 none in
#: thousands. A stopped peer pins at most this many chunks at the sender.
DATA_HWM: Final = 32
#: Requests and acks are small; a sender falling behind on them is the problem to see.
CONTROL_HWM: Final = 10_000
#: Largest message a socket that reads only small control traffic takes (a hub's ROUTER
#: and PULL): a peer cannot make a sender read, decode or hold more than this at once.
CONTROL_MAX_MESSAGE: Final = 1024 * 1024
#: How long bind() retries an address a just-closed socket may still hold.
REBIND_SECONDS: Final = 2.0
#: Seconds a peer has to complete its ZMTP (and CURVE) handshake on a hub's listening
#: socket. ZeroMQ's default (30 s) lets anyone who connects and says nothing hold one of
#: the hub's descriptors that long; an honest peer takes milliseconds, and reconnects.
HANDSHAKE_SECONDS: Final = 2.0
#: The socket types a hub binds (spokes connect DEALER, PUSH and SUB).
_LISTENING: Final = frozenset({zmq.ROUTER, zmq.PULL, zmq.PUB})
# Socket flags and options as plain ints: pyzmq's are enum members, and combining or
# testing them builds a new enum member each time, which the 1 MB send path notices.
_NOBLOCK: Final = int(zmq.NOBLOCK)
_MORE: Final = int(zmq.SNDMORE) | _NOBLOCK
_RCVMORE: Final = int(zmq.RCVMORE)
_EVENTS: Final = int(zmq.EVENTS)
_POLLIN: Final = int(zmq.POLLIN)


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Raise ZeroMQ's errors as TransportError, chained, at the adapter edge."""
    try:
        yield
    except zmq.ZMQError as exc:
        if exc.errno == zmq.ETERM:
            raise TransportClosed(f"{what}: the ZeroMQ context was terminated") from exc
        raise TransportError(f"{what}: {exc.strerror} (errno {exc.errno})") from exc


def frame_buffers(frames: list[zmq.Frame]) -> list[Buffer]:
    return [f.buffer for f in frames]


def send_parts(sock: zmq.Socket[Any], frames: Sequence[Any], *, more: bool = False) -> None:
    """``sock.send_multipart(frames, copy=False, flags=NOBLOCK)``, leaner.

    pyzmq's version checks every part and combines enum flags per part; ours are
    buffers already. Large parts go zero-copy (pyzmq copies those below the socket's
    ``copy_threshold``). ``more``: the message goes on after these parts.
    """
    send = sock.send
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        send(frame, _MORE if more or i < last else _NOBLOCK, copy=False)


def recv_parts(sock: zmq.Socket[Any], *, copy: bool) -> list[Any]:
    """``sock.recv_multipart(NOBLOCK, copy=copy)``, without its enum flags.

    ``copy=True`` (bytes) for small control messages; ``copy=False`` (frames) for data.
    Raises ``zmq.Again`` when nothing is waiting.
    """
    recv = sock.recv
    parts = [recv(_NOBLOCK, copy=copy)]
    while sock.getsockopt(_RCVMORE):
        parts.append(recv(_NOBLOCK, copy=copy))
    return parts


def readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a message waits on ``sock`` (reading ZMQ_EVENTS also re-arms its FD)."""
    return bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLIN)


class Sockets:
    """A set of sockets, a poller over them, and one wake-up pair for other threads."""

    def __init__(
        self, context: zmq.Context[Any], curve: CurveServer | CurveClient | None = None
    ) -> None:
        self.context = context
        self.curve = curve
        self.poller = zmq.Poller()
        self.sockets: list[zmq.Socket[Any]] = []
        self._wake_addr = f"inproc://zmqsync-wake-{secrets.token_hex(8)}"
        self.wake_rx = self.add(zmq.PAIR)
        self.wake_rx.bind(self._wake_addr)
        self._wake_tx = self.add(zmq.PAIR, poll=False)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self.closed = False

    def add(self, kind: int, *, poll: bool = True, hwm: int = CONTROL_HWM) -> zmq.Socket[Any]:
        sock = self.context.socket(kind)
        sock.linger = 0
        sock.sndhwm = hwm
        sock.rcvhwm = hwm
        if kind in _LISTENING:
            sock.handshake_ivl = int(HANDSHAKE_SECONDS * 1000)
        if self.curve is not None and kind != zmq.PAIR:
            self.curve.apply(sock)  # before bind/connect, or it does not take
        self.sockets.append(sock)
        if poll:
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def discard(self, sock: zmq.Socket[Any]) -> None:
        with contextlib.suppress(KeyError):
            self.poller.unregister(sock)
        with contextlib.suppress(ValueError):
            self.sockets.remove(sock)
        sock.close(linger=0)

    def wake(self) -> None:
        with self._wake_lock:
            if not self.closed:
                with contextlib.suppress(zmq.ZMQError):
                    self._wake_tx.send(b"", zmq.NOBLOCK)

    def poll(self, timeout: float | None) -> dict[zmq.Socket[Any], int]:
        # ZeroMQ waits whole milliseconds: a shorter wait is one, never zero (a caller
        # waiting 0.5 ms in a loop would otherwise spin on a core until its deadline).
        ms = None if timeout is None else 0 if timeout <= 0 else max(1, math.ceil(timeout * 1000))
        events = dict(self.poller.poll(ms))
        if self.wake_rx in events:
            with contextlib.suppress(zmq.Again):
                while True:
                    self.wake_rx.recv(zmq.NOBLOCK)
        return events

    def close(self) -> None:
        with self._wake_lock:
            if self.closed:
                return
            self.closed = True
            for sock in self.sockets:
                sock.close(linger=0)
            self.sockets.clear()


def bind(sock: zmq.Socket[Any], endpoint: str) -> str:
    """Bind, retrying briefly while a just-closed socket still holds the address."""
    deadline = time.monotonic() + REBIND_SECONDS
    while True:
        try:
            if endpoint.endswith(":*") or endpoint.endswith(":0"):
                port = sock.bind_to_random_port(endpoint.rsplit(":", 1)[0])
                return f"{endpoint.rsplit(':', 1)[0]}:{port}"
            sock.bind(endpoint)
            return cast(bytes, sock.last_endpoint).decode()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise TransportError(
                    f"cannot bind {endpoint}: {exc.strerror}"
                    + (
                        "; another process holds it: pick another endpoint"
                        if exc.errno == zmq.EADDRINUSE
                        else ""
                    )
                ) from exc
