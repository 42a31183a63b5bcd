"""The ZeroMQ hub: a ROUTER for requests and addressed sends, a PULL for acks, and
shared memory lent to ``ipc://`` peers (see :mod:`.lending`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import time
from collections.abc import Sequence
from typing import Any, Final, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from zmqsync.endpoints import (
    default_endpoint,
    derive_endpoint,
    is_loopback,
    parse_endpoint,
)
from zmqsync.errors import EndpointError
from zmqsync.protocol import Buffer
from zmqsync.security import CurveServer
from zmqsync.transport._zmq.lending import Lender
from zmqsync.transport._zmq.sockets import (
    CONTROL_MAX_MESSAGE,
    DATA_HWM,
    SPOKE_PREFIX,
    Sockets,
    bind,
    readable,
    recv_parts,
    send_parts,
    translated,
)
from zmqsync.transport.base import (
    AdmitsPeers,
    Announces,
    Counted,
    ForgetsPeers,
    HubTransport,
    Incoming,
    Lends,
    PeerId,
    Recipients,
    Stream,
    Waitable,
    ZeroCopy,
)
from zmqsync.transport.cuda import handles
from zmqsync.transport.ends import OpenEnd
from zmqsync.transport.shm.blocks import SHM_AVAILABLE
from zmqsync.transport.shm.lent import LentPeers, TakesLentTensors
from zmqsync.transport.shm.records import (
    ADDRESSED,
    FAN_OUT,
    Go,
    LentAt,
    RecordError,
    decode,
    is_lent_record,
    is_record,
)

__all__ = ["ZMQHub"]

log = logging.getLogger("zmqsync.transport")

#: Buffers at least this large are sent zero-copy (pyzmq copies smaller ones).
ZERO_COPY_MIN: Final = 64 * 1024
_HANDSHAKE_FAILED: Final = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class ZMQHub(
    OpenEnd,
    HubTransport,
    Waitable,
    TakesLentTensors,
    Lends,
    ZeroCopy,
    Announces,
    AdmitsPeers,
    ForgetsPeers,
    Counted,
):
    """Base of the ZeroMQ hubs: ROUTER for requests and addressed sends, PULL for acks.

    Subclasses choose how ``send_frames(to=None)`` fans out. Besides the contract it
    has the abilities it subclasses (see :mod:`zmqsync.transport.base`); it lends
    memory to ``ipc://`` peers, or as ``shared_memory`` says; and, unless
    ``device_memory=False``, device memory to the peers among them whose model lives on
    the learner's GPU (:mod:`zmqsync.transport.cuda`).

    Anyone who can connect may send to the ROUTER under a spoke's routing id: the hub
    keeps a peer (fans out to it, offers it shared memory) only once the sender admitted
    it (``peer_joined``), so its table is as large as the sender's sessions, whatever
    strangers do.
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
        device_memory: bool = True,
    ) -> None:
        self._tmpdir: str | None = None
        self._lender: Lender | None = None
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
        self._socks = Sockets(self._context, curve)
        self._counters = {"handshake_failures": 0, "dropped_sends": 0}
        self._zero_copy_min = ZERO_COPY_MIN  # pyzmq's copy_threshold on the data sockets
        #: Admitted spokes (see peer_joined) that a fan-out over the ROUTER reaches.
        self._peers: set[PeerId] = set()
        #: Admitted spokes found unreachable (gone, or reconnecting): skipped by fan-outs
        #: until they speak again, forgotten when the sender says they left.
        self._away: set[PeerId] = set()
        self._closed = False
        self._monitors: dict[zmq.Socket[Any], zmq.Socket[Any]] = {}
        #: The memory spokes on this host lend (their tensors), which the sender writes
        #: versions into; believed only from a spoke that joined the lending.
        self._lent = LentPeers(lambda p: f"peer {p.decode(errors='replace')}")
        #: A spoke answered an ask since recv_frames last returned.
        self._answered = False
        if (scheme == "ipc" if shared_memory is None else shared_memory) and SHM_AVAILABLE:
            self._lender = Lender(device_memory=device_memory)
        try:
            with translated(f"binding {endpoint}"):
                self._router = self._new_router()
                self._endpoint = bind(self._router, endpoint)
                self._pull = self._socks.add(zmq.PULL)
                self._pull.maxmsgsize = max_request_bytes
                self._monitor(self._pull)
                self._ack_endpoint = bind(
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

    def announce(self) -> dict[str, Any]:
        return {"ack_endpoint": self._ack_endpoint}

    def counters(self) -> dict[str, int]:
        """Rejected handshakes, dropped sends, ``peers`` (the spokes this hub keeps
        anything for: whom a fan-out over the ROUTER reaches), and shared-memory counts."""
        out = dict(self._counters)
        out["peers"] = len(self._peers) + len(self._away)
        if self._lender is not None:
            out.update(self._lender.stats())
        out.update(self._lent.counts())
        return out

    def takes_device(self, device: Any) -> bool:
        """Whether every admitted spoke reads this host's blocks and said its model
        lives on GPU ``device`` (and none keeps its versions mapped)."""
        if self._lender is None or not handles.IPC.lendable(device):
            return False
        return self._lender.takes_device(list(self._peers | self._away), device)

    def lend_device(self, nbytes: int, device: Any) -> Any:
        """``nbytes`` of memory on ``device`` that frames are later sent from as they
        are, leased to the spokes on that GPU through CUDA IPC; None when some spoke is
        not on it (:meth:`takes_device`) or no device block is free."""
        self._check_open()
        if self._lender is None or not self.takes_device(device):
            return None
        return self._lender.lend_device(nbytes, device)

    def lend(self, nbytes: int) -> Any:
        """Shared memory to carve a sender's snapshot from, when this hub lends its
        blocks (``ipc://``, or asked); else None."""
        self._check_open()
        return None if self._lender is None else self._lender.lend(nbytes)

    def unwritten(self, memory: Any) -> None:
        if self._lender is not None:
            self._lender.unwritten(memory)

    def lending(self) -> bool:
        # Before any peer joined too (as pipes and Ray do): the version a worker joins
        # on then lies in a block, and goes to it leased once it joined, not copied
        # through the socket (mapped by a shared-mode worker, never staged).
        return self._lender is not None

    def all_keep_versions(self) -> bool:
        if self._lender is None:
            return False
        peers = set(self._peers)  # the hub thread adds and drops peers
        return bool(peers) and peers <= self._lender.keeping()

    def lent_peers(self, layout: bytes) -> list[PeerId]:
        peers = self._peers  # admitted, and reachable
        return [p for p in self._lent.peers(layout) if p in peers]

    def _lent_record(self, peer: PeerId, record: bytes, *, unmaps: bool = False) -> None:
        self._send_to(peer, [record])

    def copying(self) -> dict[PeerId, int]:
        """The peers dropped from the lending for holding a block past its lease (dead,
        stopped, stuck) and not joined again: they are sent every message through the
        socket, copied. Each with the retired blocks it may still map."""
        return {} if self._lender is None else self._lender.copying()

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
        self, frames: Sequence[Buffer], *, to: Recipients = None, stream: Stream | None = None
    ) -> None:
        # ZeroMQ queues per peer, bounded by its high-water mark: nothing to supersede.
        self._check_open()
        with translated(f"sending from {self._endpoint}"):
            if self._lender is not None and self._send_lent(frames, to):
                return
            if any(handles.IPC.is_device(f) for f in frames):
                frames = _on_host(frames)  # (a repair from a device block, say)
            if to is None:
                self._fan_out(frames)
            else:
                for peer in to:
                    self._send_to(peer, frames)

    def _send_lent(self, frames: Sequence[Buffer], to: Recipients) -> bool:
        """Send large frames as a lease (places in lent blocks) to the peers that read
        them, and inline to the others. False: nothing went (no such peer, nothing large, or every
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
        if any(handles.IPC.is_device(f) for f in frames):
            return self._send_on_device(frames, counted if to is not None else known, others)
        leased = self._lender.lease(frames, counted, channel) if counted else None
        if leased is None:
            return False
        if channel == FAN_OUT:
            self._fan_out(leased.frames)
        else:
            for peer in counted:
                self._send_to(peer, leased.frames)
        for peer in others:
            self._send_to(peer, frames)
        return True

    def _send_on_device(
        self, frames: Sequence[Any], members: list[PeerId], others: list[PeerId]
    ) -> bool:
        """Frames that lie on a GPU: a lease of their device blocks to the ``members``
        that said their model lives on it, addressed (each peer's handles of the blocks
        go ahead of it, on the same socket), and host bytes to everyone else."""
        assert self._lender is not None
        device = next(f.device for f in frames if handles.IPC.is_device(f))
        takers = [p for p in members if self._lender.takes_device([p], device)]
        leased = self._lender.lease(frames, takers, ADDRESSED) if takers else None
        if leased is None:
            takers = []
        for peer in takers:
            assert leased is not None
            for grant in self._lender.grants(peer, leased):
                self._send_to(peer, [grant])
            self._send_to(peer, leased.frames)
        rest = [p for p in [*members, *others] if p not in takers]
        if rest:
            host = _on_host(frames)
            for peer in rest:
                self._send_to(peer, host)
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
                if peer in self._peers:  # still admitted: back in the fan-out once it speaks
                    self._peers.discard(peer)
                    self._away.add(peer)
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
                        incoming = self._recv_router()
                        if incoming is not None:
                            return incoming
                    if self._answered:  # the sender waiting for the answer takes it at once
                        self._answered = False
                        return None
                if self._pull in events:
                    with contextlib.suppress(zmq.Again):
                        frames = recv_parts(self._pull, copy=True)  # acks: small
                        if self._lender is None or not is_record(frames):
                            return Incoming(frames)
                        # A holding, alone or in front of an ack.
                        self._lender.on_release(frames[:1])
                        if len(frames) > 1:
                            return Incoming(frames[1:])
                woken = self._socks.wake_rx in events
                if woken or remaining == 0 or (deadline is None and not events):
                    return None

    def peer_joined(self, peer: PeerId) -> None:
        """The sender admitted ``peer``: fan-outs reach it, and over ``ipc://`` it is
        offered the hub's blocks. Only this transport's spokes are kept (a status query's
        socket gets replies, never fan-outs or offers)."""
        self._check_open()
        if not peer.startswith(SPOKE_PREFIX):
            return
        self._away.discard(peer)
        self._peers.add(peer)
        self._offer(peer)

    def peer_left(self, peer: PeerId) -> None:
        self._peers.discard(peer)
        self._away.discard(peer)
        self._lent.forget(peer)
        if self._lender is not None:
            # no longer counted; blocks it may still map are retired, never rewritten
            self._lender.drop(peer, "left")

    def _offer(self, peer: PeerId) -> None:
        """Offer an admitted ``peer`` the hub's blocks, unless it was offered them."""
        if self._lender is not None:
            offer = self._lender.offer(peer)
            if offer is not None:
                self._send_to(peer, offer)

    def _recv_router(self) -> Incoming | None:
        """One message from the ROUTER, with who its peer proved to be under CURVE."""
        if self._auth is None:
            # Requests are small: bytes cost less than frames to get.
            parts = recv_parts(self._router, copy=True)
            return self._from_router(parts[0], parts[1:])
        frames = recv_parts(self._router, copy=False)
        credential = None
        if len(frames) > 1:
            # The ZAP handler's name for the connection (see CurveServer): libzmq sets
            # it on every message, where no peer can write it.
            with contextlib.suppress(zmq.ZMQError):
                credential = frames[1].get("User-Id")
        incoming = self._from_router(frames[0].bytes, [f.bytes for f in frames[1:]])
        if incoming is None:
            return None
        return dataclasses.replace(incoming, credential=credential)

    def _from_router(self, peer: PeerId, frames: list[Buffer]) -> Incoming | None:
        """A message from the ROUTER, or None when it was part of the lending handshake.

        Nothing is kept for a peer the sender has not admitted: its message goes up to
        the sender, which decides whether it becomes a worker.
        """
        if peer in self._away:
            # Admitted, and found unreachable since: it is back (a DEALER reconnects
            # under the same routing id).
            self._away.discard(peer)
            self._peers.add(peer)
        if self._lender is None or not peer.startswith(SPOKE_PREFIX):
            return Incoming(frames, peer)
        admitted = peer in self._peers
        if is_record(frames):
            if not admitted:
                # Only an admitted peer was offered anything to answer: a join from any
                # other would make it a member, kept, of a stranger's choosing.
                self._lender.counters["bad_records"] += 1
                return None
            if is_lent_record(frames):
                self._on_lent(peer, frames[0])
                return None
            reply = self._lender.on_request(peer, frames)
            if reply is not None:
                self._send_to(peer, reply)
            return None
        if admitted:
            self._offer(peer)  # again, if the lender dropped it (unreachable, expired)
        return Incoming(frames, peer)

    def _on_lent(self, peer: PeerId, frame: Buffer) -> None:
        """Where an admitted spoke's tensors lie, or its answer to an ask. Only a spoke
        that joined the lending proved it is on this host: from any other, it is a
        bad record."""
        assert self._lender is not None
        try:
            record = decode(frame)
        except RecordError:
            record = None
        if isinstance(record, LentAt) and self._lender.is_member(peer):
            self._lent.said(peer, record)
        elif isinstance(record, Go) and self._lender.is_member(peer):
            self._lent.answered(peer, record)
            self._answered = True
        else:
            self._lender.counters["bad_records"] += 1

    def wake(self) -> None:
        self._socks.wake()

    def _waited(self, acks: bool) -> list[zmq.Socket[Any]]:
        return [s for s, _ in self._socks.poller.sockets if acks or s is not self._pull]

    def wait_handles(self, *, acks: bool = True) -> list[int]:
        # Each socket's ZMQ_FD: readable when its mailbox has news (see base).
        return [] if self._closed else [cast(int, s.getsockopt(zmq.FD)) for s in self._waited(acks)]

    def has_input(self, *, acks: bool = True) -> bool:
        if self._closed:
            return False
        with contextlib.suppress(zmq.ZMQError):
            return any(readable(s) for s in self._waited(acks))
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


def _on_host(frames: Sequence[Any]) -> list[Any]:
    """``frames`` with each one on a GPU copied to the host (a numpy array)."""
    return [f.detach().cpu().numpy() if handles.IPC.is_device(f) else f for f in frames]
