"""What the ZeroMQ adapters share: sockets, polling, error translation.

Every hub binds a ROUTER on the endpoint the user gave (requests in, addressed messages
out) and a PULL for acks; the pub/sub hub adds a PUB for fan-out. Every spoke connects a
DEALER to the ROUTER, a PUSH to the PULL and, for pub/sub, a SUB to the PUB. Spokes learn
the data and ack addresses from the hub's Welcome, so a user names one endpoint.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Final, cast

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from zmqsync.endpoints import (
    connect_address,
    default_endpoint,
    derive_endpoint,
    is_loopback,
    parse_endpoint,
)
from zmqsync.errors import EndpointError, TransportClosed, TransportError
from zmqsync.protocol import Buffer, Kind, peek_kind
from zmqsync.security import CurveClient, CurveServer
from zmqsync.transport._shm import SHM_AVAILABLE
from zmqsync.transport._zmq_shm import ADDRESSED, FAN_OUT, ShmLender, ShmReader, is_record
from zmqsync.transport.base import HubTransport, Incoming, PeerId, SpokeTransport

__all__ = ["ZMQHub", "ZMQSpoke"]

log = logging.getLogger("zmqsync.transport")

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
#: Largest frame a worker accepts unless told otherwise (a scheme with a model sets it
#: from the model's size): a peer cannot make it allocate more than this.
DEFAULT_MAX_MESSAGE: Final = 16 * 1024**3
#: Largest message a socket that reads only small control traffic takes (a hub's ROUTER
#: and PULL): a peer cannot make a sender read, decode or hold more than this at once.
CONTROL_MAX_MESSAGE: Final = 1024 * 1024
#: Buffers at least this large are sent zero-copy (pyzmq copies smaller ones).
ZERO_COPY_MIN: Final = 64 * 1024
#: How long bind() retries an address a just-closed socket may still hold.
REBIND_SECONDS: Final = 2.0
#: Seconds a peer has to complete its ZMTP (and CURVE) handshake on a hub's listening
#: socket. ZeroMQ's default (30 s) lets anyone who connects and says nothing hold one of
#: the hub's descriptors that long; an honest peer takes milliseconds, and reconnects.
HANDSHAKE_SECONDS: Final = 2.0
#: The socket types a hub binds (spokes connect DEALER, PUSH and SUB).
_LISTENING: Final = frozenset({zmq.ROUTER, zmq.PULL, zmq.PUB})
#: How long ZeroMQ's I/O thread may still try to deliver a closing spoke's last request
#: (its goodbye). The caller never waits for it; only a context's term() would.
CLOSE_LINGER_MS: Final = 100
_HANDSHAKE_FAILED: Final = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
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


def _buffers(frames: list[zmq.Frame]) -> list[Buffer]:
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


def _readable(sock: zmq.Socket[Any]) -> bool:
    """Whether a message waits on ``sock`` (reading ZMQ_EVENTS also re-arms its FD)."""
    return bool(cast(int, sock.getsockopt(_EVENTS)) & _POLLIN)


class _Sockets:
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
        ms = None if timeout is None else max(0, int(timeout * 1000))
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


def _bind(sock: zmq.Socket[Any], endpoint: str) -> str:
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
            time.sleep(0.02)


class ZMQHub(HubTransport):
    """Base of the ZeroMQ hubs: ROUTER for requests and addressed sends, PULL for acks.

    Subclasses choose how ``send_frames(to=None)`` fans out.
    """

    name = "zmq"

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        ack_endpoint: str | None = None,
        context: zmq.Context[Any] | None = None,
        max_request_bytes: int = CONTROL_MAX_MESSAGE,
        curve: CurveServer | None = None,
        insecure: bool = False,
        shared_memory: bool | None = None,
    ) -> None:
        self._tmpdir: str | None = None
        self._lender: ShmLender | None = None
        if endpoint is None:
            endpoint, self._tmpdir = default_endpoint()
        scheme, _ = parse_endpoint(endpoint)
        if not is_loopback(endpoint) and curve is None:
            if not insecure:
                raise EndpointError(
                    f"{endpoint} is reachable from other hosts and no CURVE keys were given: "
                    "anyone on the network could read the weights or send acks. Pass "
                    "curve=CurveServer.from_files(...) (keys from `zmqsync keys`), or "
                    "insecure=True if this network is trusted"
                )
            log.warning("binding %s without CURVE keys: weights travel in clear", endpoint)
        elif scheme == "tcp" and curve is None:
            # Loopback keeps other hosts out, not other users: any local process can
            # connect, unlike an ipc path in a private directory.
            log.warning(
                "binding %s without CURVE keys: every user of this host can connect, read "
                "the weights and send acks; use an ipc:// endpoint in a private directory "
                "(the default), or CURVE keys",
                endpoint,
            )
        self._auth = None
        self._own_context = curve is not None
        if curve is not None:
            # The ZAP handler is per context: a private one keeps fleets apart.
            self._context = zmq.Context()
            self._auth = curve.start_authenticator(self._context)
        else:
            self._context = context or zmq.Context.instance()
        self._max_request_bytes = max_request_bytes
        self._socks = _Sockets(self._context, curve)
        self._counters = {"handshake_failures": 0, "dropped_sends": 0}
        self._zero_copy_min = ZERO_COPY_MIN  # pyzmq's copy_threshold on the data sockets
        self._peers: set[PeerId] = set()
        self._closed = False
        self._monitors: dict[zmq.Socket[Any], zmq.Socket[Any]] = {}
        if (scheme == "ipc" if shared_memory is None else shared_memory) and SHM_AVAILABLE:
            self._lender = ShmLender()
        try:
            with translated(f"binding {endpoint}"):
                self._router = self._new_router()
                self._endpoint = _bind(self._router, endpoint)
                self._pull = self._socks.add(zmq.PULL)
                self._pull.maxmsgsize = max_request_bytes
                self._monitor(self._pull)
                self._ack_endpoint = _bind(
                    self._pull, ack_endpoint or derive_endpoint(endpoint, "acks", 2)
                )
                self._bind_data(endpoint)
        except BaseException:
            self.close()
            raise

    # --- subclass hooks --------------------------------------------------------------

    def _bind_data(self, endpoint: str) -> None:
        """Bind the fan-out socket, if the adapter has one."""

    def _fan_out(self, frames: Sequence[Buffer]) -> None:
        raise NotImplementedError

    def _fan_out_channel(self) -> int:
        """The channel a fan-out goes on now: FAN_OUT (one socket reaches every
        subscriber) or ADDRESSED (one message per known peer, over the ROUTER)."""
        return ADDRESSED

    # --- sockets ---------------------------------------------------------------------

    def _new_router(self) -> zmq.Socket[Any]:
        router = self._socks.add(zmq.ROUTER, hwm=DATA_HWM)
        router.router_mandatory = 1
        router.router_handover = 1
        router.maxmsgsize = self._max_request_bytes
        router.sndtimeo = 0
        router.copy_threshold = self._zero_copy_min
        self._monitor(router)
        return router

    def _monitor(self, sock: zmq.Socket[Any]) -> None:
        mon = sock.get_monitor_socket(_HANDSHAKE_FAILED)
        self._monitors[sock] = mon
        self._socks.poller.register(mon, zmq.POLLIN)

    def _unmonitor(self, sock: zmq.Socket[Any]) -> None:
        mon = self._monitors.pop(sock, None)
        if mon is not None:
            with contextlib.suppress(KeyError):
                self._socks.poller.unregister(mon)
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            mon.close(linger=0)

    def _drain_monitor(self, mon: zmq.Socket[Any]) -> None:
        with contextlib.suppress(zmq.Again, zmq.ZMQError):
            while True:
                event = recv_monitor_message(mon, zmq.NOBLOCK)
                if event["event"] & _HANDSHAKE_FAILED:
                    self._counters["handshake_failures"] += 1

    # --- HubTransport ----------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"hub at {self._endpoint} is closed")

    def announce(self) -> dict[str, Any]:
        return {"ack_endpoint": self._ack_endpoint}

    def counters(self) -> dict[str, int]:
        out = dict(self._counters)
        if self._lender is not None:
            out.update(self._lender.stats())
        return out

    def shared_buffer(self, nbytes: int) -> Any:
        """Shared memory to carve a sender's snapshot from, while some peer reads this
        hub's blocks (``ipc://`` peers on this host); else None."""
        self._check_open()
        return None if self._lender is None else self._lender.shared_buffer(nbytes)

    def shares_memory(self) -> bool:
        return self._lender is not None and bool(self._lender.members())

    def zero_copy_from(self, nbytes: int) -> None:
        """pyzmq copies parts under its ``copy_threshold`` (64 KiB): lower it to ``nbytes``
        for a sender that packs nothing, so that even small tensors go from their own
        memory (at pyzmq's cost per zero-copy part)."""
        self._zero_copy_min = min(ZERO_COPY_MIN, max(0, int(nbytes)))
        for sock in self._data_sockets():
            sock.copy_threshold = self._zero_copy_min

    def _data_sockets(self) -> list[zmq.Socket[Any]]:
        """The sockets weights go out on (their ``copy_threshold`` follows the sender's)."""
        return [self._router]

    def send_frames(
        self, frames: Sequence[Buffer], *, to: Collection[PeerId] | None = None
    ) -> None:
        self._check_open()
        with translated(f"sending from {self._endpoint}"):
            if self._lender is not None and self._send_shared(frames, to):
                return
            if to is None:
                self._fan_out(frames)
            else:
                for peer in to:
                    self._send_to(peer, frames)

    def _send_shared(self, frames: Sequence[Buffer], to: Collection[PeerId] | None) -> bool:
        """Send large frames as places in shared blocks to the peers that read them, and
        inline to the others. False: nothing went (no such peer, nothing large, or every
        block busy): send as usual."""
        assert self._lender is not None
        self._lender.expire()
        members = self._lender.members()
        if not members:
            return False
        channel = ADDRESSED if to is not None else self._fan_out_channel()
        if to is None:
            # A fan-out reaches every subscriber: count every member. Addressed, it
            # reaches the peers the hub knows.
            known = [p for p in self._peers if p in members]
            counted = list(members) if channel == FAN_OUT else known
            others = [p for p in self._peers if p not in members]
        else:
            counted = [p for p in to if p in members]
            others = [p for p in to if p not in members]
        shared = self._lender.share(frames, counted, channel) if counted else None
        if shared is None:
            return False
        if channel == FAN_OUT:
            self._fan_out(shared)
        else:
            for peer in counted:
                self._send_to(peer, shared)
        for peer in others:
            self._send_to(peer, frames)
        return True

    def _send_to(self, peer: PeerId, frames: Sequence[Buffer]) -> None:
        try:
            send_parts(self._router, [peer], more=True)
            send_parts(self._router, frames)
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            # Gone, or its queue is full: the sync layer sees the missing ack and repairs.
            self._counters["dropped_sends"] += 1
            if exc.errno == zmq.EHOSTUNREACH:
                self._peers.discard(peer)
                if self._lender is not None:
                    self._lender.drop(peer, "unreachable")

    def recv_frames(self, timeout: float | None) -> Incoming | None:
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        with translated(f"receiving on {self._endpoint}"):
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                events = self._socks.poll(remaining)
                for mon in self._monitors.values():
                    if mon in events:
                        self._drain_monitor(mon)
                if self._router in events:
                    with contextlib.suppress(zmq.Again):
                        # Requests are small: bytes cost less than frames to get.
                        parts = recv_parts(self._router, copy=True)
                        incoming = self._from_router(parts[0], parts[1:])
                        if incoming is not None:
                            return incoming
                if self._pull in events:
                    with contextlib.suppress(zmq.Again):
                        frames = recv_parts(self._pull, copy=True)  # acks: small
                        if self._lender is None or not is_record(frames):
                            return Incoming(frames)
                        # A release, alone or in front of an ack.
                        self._lender.on_release(frames[:1])
                        if len(frames) > 1:
                            return Incoming(frames[1:])
                woken = self._socks.wake_rx in events
                if woken or remaining == 0 or (deadline is None and not events):
                    return None

    def peer_left(self, peer: PeerId) -> None:
        self._peers.discard(peer)
        if self._lender is not None:
            # no longer counted; blocks it may still map are retired, never rewritten
            self._lender.drop(peer, "left")

    def _from_router(self, peer: PeerId, frames: list[Buffer]) -> Incoming | None:
        """A message from the ROUTER, or None when it was the shared-memory handshake."""
        if not peer.startswith(SPOKE_PREFIX):
            return Incoming(frames, peer)
        self._peers.add(peer)
        if self._lender is None:
            return Incoming(frames, peer)
        if is_record(frames):
            reply = self._lender.on_request(peer, frames)
            if reply is not None:
                self._send_to(peer, reply)
            return None
        offer = self._lender.offer(peer)
        if offer is not None:
            self._send_to(peer, offer)
        return Incoming(frames, peer)

    def wake(self) -> None:
        self._socks.wake()

    def _waited(self, acks: bool) -> list[zmq.Socket[Any]]:
        return [s for s, _ in self._socks.poller.sockets if acks or s is not self._pull]

    def wait_handles(self, *, acks: bool = True) -> list[int] | None:
        # Each socket's ZMQ_FD: readable when its mailbox has news (see base).
        return [] if self._closed else [cast(int, s.getsockopt(zmq.FD)) for s in self._waited(acks)]

    def has_input(self, *, acks: bool = True) -> bool:
        if self._closed:
            return False
        with contextlib.suppress(zmq.ZMQError):
            return any(_readable(s) for s in self._waited(acks))
        return True  # cannot tell: have the waiter look

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in list(self._monitors):
            self._unmonitor(sock)
        self._socks.close()
        if self._lender is not None:
            self._lender.close()
        if self._auth is not None:
            self._auth.stop()
        if self._own_context:
            self._context.term()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)


class ZMQSpoke(SpokeTransport):
    """A worker's ZeroMQ end: DEALER to the hub's ROUTER, PUSH for acks, SUB for fan-out."""

    name = "zmq"

    def __init__(
        self,
        endpoint: str,
        *,
        identity: str = "",
        context: zmq.Context[Any] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE,
        curve: CurveClient | None = None,
    ) -> None:
        parse_endpoint(endpoint)
        self._endpoint = endpoint
        self._context = context or zmq.Context.instance()
        self._socks = _Sockets(self._context, curve)
        self._max_message_bytes = max_message_bytes
        self._closed = False
        self.peer_id: PeerId = SPOKE_PREFIX + f"{identity}:{secrets.token_hex(6)}".encode()
        self._push: zmq.Socket[Any] | None = None
        self._sub: zmq.Socket[Any] | None = None
        self._ack_address = ""
        self._data_address = ""
        #: Reads large frames in place from the hub's shared blocks, once the hub offered
        #: them and this process could open them (same host); inert otherwise.
        self._shm = ShmReader(self._request)
        with translated(f"connecting to {endpoint}"):
            self._dealer = self._socks.add(zmq.DEALER)
            self._dealer.routing_id = self.peer_id
            self._dealer.maxmsgsize = max_message_bytes
            self._dealer.sndtimeo = 0
            self._dealer.connect(endpoint)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def lends_memory(self) -> bool:  # type: ignore[override]
        """True while the hub counts this spoke as a reader of its shared blocks."""
        return self._shm.active

    def counters(self) -> dict[str, int]:
        """Shared-memory counts: frames read in place, messages skipped, failures."""
        return self._shm.stats()

    def _request(self, frames: list[bytes]) -> None:
        with contextlib.suppress(zmq.ZMQError):  # lost: the hub offers again, or never
            send_parts(self._dealer, frames)

    def _report(self) -> None:
        """Tell the hub which blocks this spoke let go of, on the ack channel (so it
        arrives before the ack that follows)."""
        if self._push is None:
            return
        record = self._shm.pending_report()
        if record is not None:
            with contextlib.suppress(zmq.ZMQError):
                send_parts(self._push, record)

    def follow(self, announced: dict[str, Any]) -> None:
        with translated(f"following {self._endpoint}"):
            ack = connect_address(str(announced.get("ack_endpoint") or ""), self._endpoint)
            if ack and ack != self._ack_address:
                if self._push is not None:
                    self._socks.discard(self._push)
                self._push = self._socks.add(zmq.PUSH, poll=False)
                self._push.maxmsgsize = CONTROL_MAX_MESSAGE  # it never reads: nothing to take
                self._push.sndtimeo = 0
                self._push.connect(ack)
                self._ack_address = ack
            data = connect_address(str(announced.get("data_endpoint") or ""), self._endpoint)
            if data and data != self._data_address:
                if self._sub is not None:
                    self._socks.discard(self._sub)
                self._sub = self._socks.add(zmq.SUB, hwm=DATA_HWM)
                self._sub.maxmsgsize = self._max_message_bytes
                self._sub.subscribe(b"")
                self._sub.connect(data)
                self._data_address = data

    def send_frames(self, frames: Sequence[Buffer]) -> None:
        if self._closed:
            raise TransportClosed(f"spoke of {self._endpoint} is closed")
        # DESIGN: acks travel PUSH -> PULL; everything else is a request to the ROUTER.
        sock = self._push if self._push is not None and peek_kind(frames[0]) is Kind.ACK else None
        with translated(f"sending to {self._endpoint}"):
            if sock is None:
                self._report()
            else:
                # A release rides in front of the ack, in the same message: one send.
                record = self._shm.pending_report()
                if record is not None:
                    frames = [*record, *frames]
            # Not connected yet, or the hub is not reading: a lost request is retried.
            with contextlib.suppress(zmq.Again):
                send_parts(sock or self._dealer, frames)

    def recv_frames(self, timeout: float | None) -> list[Buffer] | None:
        if self._closed:
            raise TransportClosed(f"spoke of {self._endpoint} is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        with translated(f"receiving from {self._endpoint}"):
            while True:
                self._report()
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                events = self._socks.poll(remaining)
                for sock in (self._dealer, self._sub):
                    if sock is not None and sock in events:
                        with contextlib.suppress(zmq.Again):
                            frames = _buffers(recv_parts(sock, copy=False))
                            if not is_record(frames):
                                return frames
                            resolved = self._shm.on_record(frames)
                            if resolved is not None:
                                return resolved
                woken = self._socks.wake_rx in events
                if woken or remaining == 0 or (deadline is None and not events):
                    return None

    def wake(self) -> None:
        self._socks.wake()

    def lent(self, buffers: Sequence[Buffer]) -> bool:
        # Block views are numpy arrays; frames off the socket are memoryviews. A version
        # that came through the socket is freed after the ack (off the critical path),
        # even while this spoke reads other versions from the hub's blocks.
        return any(isinstance(b, np.ndarray) for b in buffers)

    def has_input(self) -> bool:
        if self._closed:
            return False
        with contextlib.suppress(zmq.ZMQError):
            return any(s is not None and _readable(s) for s in (self._dealer, self._sub))
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(zmq.ZMQError):
            self._dealer.close(linger=CLOSE_LINGER_MS)  # a goodbye just sent still goes
        self._socks.close()
        self._shm.close()
