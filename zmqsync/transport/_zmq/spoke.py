"""The ZeroMQ spoke: a DEALER to the hub's ROUTER, a PUSH for acks, a SUB for fan-out,
and large frames read in place from the hub's lent blocks (see :mod:`.borrowing`)."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import torch
import zmq

from zmqsync.endpoints import connect_address, parse_endpoint
from zmqsync.protocol import Buffer
from zmqsync.security import CurveClient
from zmqsync.transport._zmq.borrowing import Borrower
from zmqsync.transport._zmq.sockets import (
    CONTROL_MAX_MESSAGE,
    DATA_HWM,
    SPOKE_PREFIX,
    Sockets,
    frame_buffers,
    readable,
    recv_parts,
    send_parts,
    translated,
)
from zmqsync.transport.base import Borrows, Counted, Follows, Peekable, PeerId, SpokeTransport
from zmqsync.transport.ends import OpenEnd
from zmqsync.transport.shm.lent import Where, lent_at
from zmqsync.transport.shm.records import Go, encode, is_lent_record, is_record, written_in

__all__ = ["ZMQSpoke"]

#: Largest frame a worker accepts unless told otherwise (a scheme with a model sets it
#: from the model's size): a peer cannot make it allocate more than this.
DEFAULT_MAX_MESSAGE: Final = 16 * 1024**3
#: How long ZeroMQ's I/O thread may still try to deliver a closing spoke's last request
#: (its goodbye). The caller never waits for it; only a context's term() would.
CLOSE_LINGER_MS: Final = 100


class ZMQSpoke(OpenEnd, SpokeTransport, Peekable, Borrows, Follows, Counted):
    """A worker's ZeroMQ end: DEALER to the hub's ROUTER, PUSH for acks, SUB for fan-out.

    Besides the contract it has the abilities it subclasses (see
    :mod:`zmqsync.transport.base`).
    """

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
        self._socks = Sockets(self._context, curve)
        self._max_message_bytes = max_message_bytes
        self._closed = False
        self.peer_id: PeerId = SPOKE_PREFIX + f"{identity}:{secrets.token_hex(6)}".encode()
        self._push: zmq.Socket[Any] | None = None
        self._sub: zmq.Socket[Any] | None = None
        self._ack_address = ""
        self._data_address = ""
        #: Reads large frames in place from the hub's lent blocks, once the hub offered
        #: them and this process could open them (same host); inert otherwise.
        self._borrower = Borrower(self._request)
        with translated(f"connecting to {endpoint}"):
            self._dealer = self._socks.add(zmq.DEALER)
            self._dealer.routing_id = self.peer_id
            self._dealer.maxmsgsize = max_message_bytes
            self._dealer.sndtimeo = 0
            self._dealer.connect(endpoint)

    def counters(self) -> dict[str, int]:
        """Shared-memory counts: ``borrowing`` (1 while the hub counts this spoke as a
        reader of its lent blocks, else 0), frames read in place, messages skipped,
        failures."""
        return self._borrower.stats()

    def keep_versions(self) -> None:
        self._borrower.keep_versions()

    def take_device(self, device: Any) -> None:
        self._borrower.take_device(device)

    def lends_tensors(self) -> bool:
        # Only a spoke the hub counts as a reader of its blocks proved it is on the
        # learner's host (it opened the hub's probe through /proc): the hub believes
        # what it lends from no other.
        return not self._closed and self._borrower.active

    def lend_tensors(self, where: Where | None, layout: bytes) -> None:
        self._request([encode(lent_at(where, layout))])

    def answer(self, version: int, epoch: int, ok: bool) -> None:
        self._request([encode(Go(version, epoch, ok))])

    def _request(self, frames: list[bytes]) -> None:
        with contextlib.suppress(zmq.ZMQError):  # lost: the hub offers again, or never
            send_parts(self._dealer, frames)

    def _report(self) -> None:
        """Tell the hub which blocks this spoke let go of, on the ack channel (so it
        arrives before the ack that follows)."""
        if self._push is None:
            return
        record = self._borrower.pending_release()
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

    def send_frames(self, frames: Sequence[Buffer], *, ack: bool = False) -> None:
        self._check_open()
        # DESIGN: acks travel PUSH -> PULL; everything else is a request to the ROUTER.
        sock = self._push if ack else None
        with translated(f"sending to {self._endpoint}"):
            if sock is None:
                self._report()
            else:
                # A holding rides in front of the ack, in the same message: one send.
                record = self._borrower.pending_release()
                if record is not None:
                    frames = [*record, *frames]
            # Not connected yet, or the hub is not reading: a lost request is retried.
            with contextlib.suppress(zmq.Again):
                send_parts(sock or self._dealer, frames)

    def recv_frames(self, timeout: float | None) -> list[Buffer] | None:
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        with translated(f"receiving from {self._endpoint}"):
            while True:
                self._report()
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                events = self._socks.poll(remaining)
                for sock in (self._dealer, self._sub):
                    if sock is not None and sock in events:
                        with contextlib.suppress(zmq.Again):
                            frames = frame_buffers(recv_parts(sock, copy=False))
                            if not is_record(frames):
                                return frames
                            if is_lent_record(frames):
                                # The hub's Ask or Written: the receiver's to act on.
                                record = bytes(frames[0])
                                if written_in(record):
                                    self._borrower.forget_blocks()
                                return [record]
                            resolved = self._borrower.on_record(frames)
                            if resolved is not None:
                                return resolved
                woken = self._socks.wake_rx in events
                if woken or remaining == 0 or (deadline is None and not events):
                    return None

    def borrowed(self, buffers: Sequence[Buffer]) -> bool:
        # Block views are numpy arrays; frames off the socket are memoryviews. A version
        # that came through the socket is freed after the ack (off the critical path),
        # even while this spoke reads other versions from the hub's blocks.
        return any(isinstance(b, np.ndarray | torch.Tensor) for b in buffers)

    def has_input(self) -> bool:
        if self._closed:
            return False
        with contextlib.suppress(zmq.ZMQError):
            return any(s is not None and readable(s) for s in (self._dealer, self._sub))
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(zmq.ZMQError):
            self._dealer.close(linger=CLOSE_LINGER_MS)  # a goodbye just sent still goes
        self._socks.close()
        self._borrower.close()
