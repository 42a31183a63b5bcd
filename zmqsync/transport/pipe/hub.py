"""The learner's end of the pipe transport: one duplex pipe per worker."""

from __future__ import annotations

import logging
import os
import select
import selectors
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Final

import numpy as np

from zmqsync.errors import TransportError
from zmqsync.protocol import Buffer
from zmqsync.transport.base import (
    Counted,
    ForgetsPeers,
    HubTransport,
    Incoming,
    Lends,
    PeerId,
    Recipients,
    Stream,
    Waitable,
)
from zmqsync.transport.cuda import handles
from zmqsync.transport.cuda.blocks import DevicePool
from zmqsync.transport.cuda.handles import DEVICE_IDS
from zmqsync.transport.ends import FixedPeers, OpenEnd, worker_index
from zmqsync.transport.pipe import framing
from zmqsync.transport.pipe.buffers import BufferPool, owned
from zmqsync.transport.pipe.framing import ASSIGN, HEADER, Received, socket_of
from zmqsync.transport.pipe.units import UnitReader
from zmqsync.transport.pipe.writer import Outgoing, Writer, close_end
from zmqsync.transport.shm.blocks import SHM_AVAILABLE, BlockPool, Ref
from zmqsync.transport.shm.lent import LentPeers, TakesLentTensors
from zmqsync.transport.shm.records import Go, LentAt, Release
from zmqsync.transport.wakeup import Wakeup

__all__ = ["PipeHub", "peer_id"]

log = logging.getLogger("zmqsync.transport.pipe")

#: What a hub accepts in one message from a worker. Workers send acks and requests (a
#: few KiB); a bigger message is a confused peer, refused before it is allocated.
DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024


#: Units read from one worker in a turn while it has more there (then the others get
#: theirs: one chatty worker cannot starve them).
_UNITS_PER_TURN: Final = 8


def peer_id(index: int) -> PeerId:
    """The hub's peer id of the worker at ``index``: ``b"pipe:3"``."""
    return b"pipe:%d" % index


@dataclass(eq=False)  # one per pipe: hashed by identity
class _Peer:
    index: int
    conn: Connection = field(repr=False)
    sock: socket.socket = field(repr=False)
    writer: Writer = field(repr=False)
    #: Its units, read as they come (a unit it wrote in part waits for the rest).
    reader: UnitReader = field(repr=False)
    lost: str | None = None
    #: It said goodbye and has said nothing since: its pipe's end is expected news.
    left: bool = False


class PipeHub(
    OpenEnd,
    FixedPeers,
    HubTransport,
    TakesLentTensors,
    Lends,
    Waitable,
    Counted,
    ForgetsPeers,
):
    """The learner's end: one duplex pipe per worker.

    Args:
        pipes: the learner's end of each worker's ``multiprocessing.Pipe()``; a sequence
            (worker ``i`` is ``pipes[i]``) or a mapping ``{worker_index: pipe_end}``.
            Each pipe must carry nothing but this hub's messages.
        max_message_bytes: the largest message accepted from a worker.
        shared_memory: send large frames through shared-memory blocks (Linux), written
            once and read by every worker in place, instead of through each pipe.
        device_memory: lend blocks of device memory to workers on the learner's GPU
            (with ``shared_memory``): a version there is written once into one and
            copied device to device by each worker (:mod:`zmqsync.transport.cuda`).

    Peer ids are ``b"pipe:<index>"`` (:func:`peer_id`). A worker whose pipe breaks (it
    exited or was killed) is counted in ``counters()["peers_lost"]``; sends to it are
    dropped, never raised. Besides the contract it has the
    abilities it subclasses: ``Lends``, ``Waitable`` (the sender's thread between sends
    waits on the pipes holding nothing, so a send takes the hub without waking it),
    ``Counted``, and ``TracksPeers`` (as :class:`~zmqsync.transport.ends.FixedPeers`).
    """

    name = "pipe"

    def __init__(
        self,
        pipes: Sequence[Connection] | Mapping[int, Connection],
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        shared_memory: bool = True,
        device_memory: bool = True,
    ) -> None:
        items: Iterable[tuple[int, Connection]] = (
            pipes.items() if isinstance(pipes, Mapping) else enumerate(pipes)
        )
        self._max_message_bytes = max_message_bytes
        self._peers: dict[PeerId, _Peer] = {}
        self._closed = False
        self._dropped = 0
        self._lost = 0
        # Guards the peer table (add_pipe may run beside recv_frames).
        self._lock = threading.Lock()
        self._endpoint = f"pipe://{os.getpid()}"
        self._rotate = 0
        #: Workers whose pipe holds part of a unit (read on recv_frames' thread only).
        self._partial: set[_Peer] = set()
        self._wakeup = Wakeup()  # wakes a recv_frames blocked on the pipes
        #: What recv_frames waits on, kept while the live pipes stay the same (a
        #: selector made at each call cost a registration per pipe per message).
        self._selector: selectors.BaseSelector | None = None
        self._selected: tuple[Connection, ...] = ()
        self._pool = BufferPool()
        self._shm = BlockPool() if shared_memory and SHM_AVAILABLE else None
        #: Device blocks: versions on the learner's GPU, lent to workers on that GPU.
        self._device = DevicePool() if self._shm is not None and device_memory else None
        self._bad_releases = 0
        #: The memory workers lend (their tensors), which the sender writes versions into.
        self._lent = LentPeers(lambda p: f"worker {p.decode(errors='replace')}")
        try:
            for index, conn in items:
                self.add_pipe(conn, index)
        except BaseException:
            self.close()
            raise

    def add_pipe(self, pipe: Connection, index: int) -> PeerId:
        """Serve one more worker at ``index`` (a late joiner), or replace the pipe of a
        worker whose pipe broke (a restarted worker). Returns its peer id."""
        self._check_open()
        index = worker_index(index)
        with self._lock:
            old = self._peers.get(peer_id(index))
            if old is not None and old.lost is None:
                raise ValueError(f"worker {index} already has a working pipe")
            sock = socket_of(pipe, f"pipe of worker {index}")
            writer = Writer(pipe, sock, f"hub-{index}", self._shm, self._device)
            # Before anything else on this pipe: tell the worker who it is.
            writer.put(Outgoing(None, record=HEADER.pack(ASSIGN, index)))
            peer = _Peer(index, pipe, sock, writer, UnitReader(sock, self._max_message_bytes))
            self._peers[peer_id(index)] = peer
        if old is not None:
            close_end(old.conn, old.sock, old.writer)
        self.wake()  # a blocked recv_frames starts listening to the new pipe
        return peer_id(index)

    def _bound(self) -> Mapping[PeerId, _Peer]:
        return self._peers

    def _lose(self, peer: _Peer, why: str) -> None:
        if peer.lost is None:
            peer.lost = why
            self._lost += 1
            peer.writer.stop()
            self._lent.forget(peer_id(peer.index))  # unmapped with the last view
            for pool in (self._shm, self._device):
                if pool is not None:
                    pool.forget(peer.writer)  # it reads no block any more
            if peer.left:  # a worker that closed after its goodbye: nothing went wrong
                log.debug("worker %d closed its pipe after its goodbye (%s)", peer.index, why)
            else:
                log.warning("pipe of worker %d broke (%s): the worker is gone", peer.index, why)

    def peer_left(self, peer: PeerId) -> None:
        """``peer`` said goodbye: the end of its pipe that follows is no breakage (a
        collector's normal shutdown is not logged as a warning per worker)."""
        with self._lock:
            found = self._peers.get(peer)
            if found is not None:
                found.left = True

    def send_frames(
        self, frames: Sequence[Buffer], *, to: Recipients = None, stream: Stream | None = None
    ) -> None:
        self._check_open()
        with self._lock:
            if to is None:
                targets: list[_Peer | None] = list(self._peers.values())
            else:
                targets = [self._peers.get(p) for p in to]
        if not targets:
            return
        placed, keep = self._place(frames)
        frames_owned, buf = owned(placed, self._pool)
        item = Outgoing(frames_owned, stream, keep=keep)
        if buf is not None:
            # Free again once every writer has written (or dropped) this message.
            self._pool.watch(buf, [item])
        for peer in targets:
            if peer is None or peer.lost is not None:
                self._dropped += 1
                continue
            if peer.writer.broken is not None:
                self._lose(peer, peer.writer.broken)
            peer.writer.put(item)

    def _place(self, frames: Sequence[Buffer]) -> tuple[list[Buffer | Ref], list[Any]]:
        kept: list[Any] = []
        if self._device is not None and any(handles.IPC.is_device(f) for f in frames):
            frames, kept = self._device.place_device(frames)
        if self._shm is None:
            return list(frames), kept
        placed, keep = self._shm.place(frames)
        return placed, keep + kept

    def lending(self) -> bool:
        return self._shm is not None

    def lend(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of shared memory that frames are later sent from without a copy
        (once they are read-only views of it), or None when there is none to lend."""
        self._check_open()
        if self._shm is None:
            return None
        lent = self._shm.lend(nbytes)
        return None if lent is None else lent[1]

    def unwritten(self, memory: Any) -> None:
        if self._shm is not None:
            self._shm.unwritten(memory)

    def takes_device(self, device: Any) -> bool:
        """Whether every worker said its model lives on ``device`` (a CUDA device of
        this host) and reads each version in place (none is sent copies)."""
        if self._device is None or not handles.IPC.lendable(device):
            return False
        uuid = handles.IPC.uuid_of(device)
        with self._lock:
            live = [p for p in self._peers.values() if p.lost is None]
        return bool(live) and all(p.writer.device == uuid and not p.writer.copying for p in live)

    def lend_device(self, nbytes: int, device: Any) -> Any:
        """``nbytes`` of memory on ``device`` that frames are later sent from as they
        are, leased to workers on that GPU through CUDA IPC; None when some worker is
        not on it (:meth:`takes_device`) or no device block is free."""
        self._check_open()
        if self._device is None or not self.takes_device(device):
            return None
        lent = self._device.lend_on(nbytes, device)
        return None if lent is None else lent[1]

    def lent_peers(self, layout: bytes) -> list[PeerId]:
        return self._lent.peers(layout)

    def _lent_record(self, peer: PeerId, record: bytes, *, unmaps: bool = False) -> None:
        with self._lock:
            found = self._peers.get(peer)
        if found is None or found.lost is not None:
            self._dropped += 1
            return
        # The worker waits for it: written on this thread, no hop to the writer's.
        if not found.writer.put_now(record, unmaps=unmaps):
            found.writer.put(Outgoing(None, record=record, unmaps=unmaps))

    def recv_frames(self, timeout: float | None) -> Incoming | None:
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                live = {p.conn: p for p in self._peers.values() if p.lost is None}
            now = time.monotonic()
            remaining = None if deadline is None else max(0.0, deadline - now)
            wait = self._stalls(now, remaining)
            try:
                events = self._selector_for(live).select(wait)
            except (OSError, ValueError) as exc:
                if any(conn.closed for conn in live):
                    continue  # add_pipe() replaced a broken pipe meanwhile: look again
                raise TransportError(f"waiting on worker pipes failed: {exc}") from exc
            ready: list[_Peer] = [key.data for key, _ in events if key.data is not None]
            woken = len(ready) < len(events)
            if woken:
                self._wakeup.drain()
            if len(ready) > 1:  # take turns, so one chatty worker cannot starve the others
                self._rotate = (self._rotate + 1) % len(ready)
                ready = ready[self._rotate :] + ready[: self._rotate]
            for peer in ready:
                # What a worker writes at once (its releases and its ack, in one write)
                # is read in one turn, not one unit per round of the selector.
                for _ in range(_UNITS_PER_TURN):
                    if peer.lost is not None or peer.conn.closed:
                        break  # replaced or lost meanwhile: the next round looks again
                    try:
                        got = peer.reader.read()
                    except (EOFError, OSError) as exc:
                        why = f"{type(exc).__name__}: {exc}" if str(exc) else "end of file"
                        self._lose(peer, why)
                        break
                    if got is None:  # nothing more now (a unit begun waits for the rest)
                        if peer.reader.since is not None:
                            self._partial.add(peer)
                        break
                    done, incoming = self._took(peer, got)
                    if done:
                        return incoming
            if woken or (not events and deadline is not None and time.monotonic() >= deadline):
                return None

    def _stalls(self, now: float, remaining: float | None) -> float | None:
        """Give up the pipes of workers that wrote part of a unit and nothing more for
        ``STALL_SECONDS`` (stopped, or hostile: the stream cannot be resynchronised);
        returns how long to wait for the others: ``remaining``, or less, until the next
        of those pipes would be given up."""
        if not self._partial:
            return remaining
        wait = remaining
        for peer in list(self._partial):
            since = peer.reader.since
            if peer.lost is not None or since is None:
                self._partial.discard(peer)
                continue
            left = since + framing.STALL_SECONDS - now
            if left <= 0:
                self._partial.discard(peer)
                why = f"it wrote part of a unit and nothing for {framing.STALL_SECONDS:g}s"
                self._lose(peer, why)
            elif wait is None or left < wait:
                wait = left
        return wait

    def _took(self, peer: _Peer, got: Received) -> tuple[bool, Incoming | None]:
        """Act on a unit ``peer`` sent: whether :meth:`recv_frames` returns now, and
        with what (a message; None for a lent-tensor answer, which the sender waiting
        for it takes at once); ``(False, None)`` for a unit that was the hub's own (a
        release)."""
        peer.writer.heard()
        if got.release is not None:
            self._on_release(peer, got.release)
        elif got.keeps:
            peer.writer.keeps_versions = True
        elif got.device is not None:
            peer.writer.device = got.device
        elif isinstance(got.lent, LentAt):
            self._lent.said(peer_id(peer.index), got.lent)
        elif isinstance(got.lent, Go):
            self._lent.answered(peer_id(peer.index), got.lent)
            return True, None
        elif got.frames is not None:
            peer.left = False  # back after its goodbye (a hello), or never gone
            # A message beats a wake-up: whoever woke us wants the hub, and gets it
            # back at once either way.
            return True, Incoming(got.frames, peer_id(peer.index))
        return False, None

    def _selector_for(self, live: dict[Connection, _Peer]) -> selectors.BaseSelector:
        """The selector of the wake-up and of the ``live`` pipes (made again when they
        change: a peer lost, a pipe added or replaced)."""
        conns = tuple(live)
        if self._selector is None or conns != self._selected:
            if self._selector is not None:
                self._selector.close()
            self._selected = ()
            self._selector = selectors.PollSelector()
            self._selector.register(self._wakeup.fileno(), selectors.EVENT_READ, None)
            for conn, peer in live.items():
                self._selector.register(conn.fileno(), selectors.EVENT_READ, peer)
            self._selected = conns
        return self._selector

    def _on_release(self, peer: _Peer, release: Release) -> None:
        for block_id in release.blocks:
            pool = self._device if block_id >= DEVICE_IDS else self._shm
            if pool is None or not pool.release(block_id, peer.writer):
                self._bad_releases += 1
            else:
                peer.writer.released()

    def all_keep_versions(self) -> bool:
        with self._lock:
            live = [p for p in self._peers.values() if p.lost is None]
        # One sent copies (stopped, stuck) takes each chunk as a private copy: small ones.
        return (
            self._shm is not None
            and bool(live)
            and all(p.writer.keeps_versions and not p.writer.copying for p in live)
        )

    def wake(self) -> None:
        self._wakeup.wake()

    def wait_handles(self, *, acks: bool = True) -> list[int]:
        # The live pipes (level-triggered: readable until recv_frames reads what came;
        # acks share them with everything else, so ``acks`` leaves nothing out) and the
        # hub's wake-up, so that a pipe added wakes the waiter to listen to it too.
        if self._closed:
            return []
        with self._lock:
            conns = [p.conn for p in self._peers.values() if p.lost is None]
        return [self._wakeup.fileno(), *(c.fileno() for c in conns if not c.closed)]

    def has_input(self, *, acks: bool = True) -> bool:
        handles = self.wait_handles(acks=acks)
        if not handles:
            return False
        poller = select.poll()
        for fd in handles:
            poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))

    def counters(self) -> dict[str, int]:
        with self._lock:
            peers = list(self._peers.values())
        counts = {
            "dropped_sends": self._dropped + sum(p.writer.dropped for p in peers),
            "peers_lost": self._lost,
        }
        if self._shm is not None:
            counts["shm_bytes"] = self._shm.nbytes()
            counts["shm_fallbacks"] = self._shm.fallbacks
            counts["bad_releases"] = self._bad_releases
            copying = self.copying()
            counts["shm_copying"] = len(copying)
            counts["shm_pinned"] = sum(copying.values())
            counts["shm_copies"] = sum(p.writer.copies for p in peers)
        counts.update(self._lent.counts())
        if self._device is not None and (self._device.nbytes() or self._device.refused):
            counts["device_bytes"] = self._device.nbytes()
            counts["device_refused"] = self._device.refused
        return counts

    def copying(self) -> dict[PeerId, int]:
        """The workers now sent each version copied through their pipe (they keep
        versions mapped and hold one they have not taken in: stopped, stuck), each with
        the blocks it pins meanwhile."""
        if self._shm is None:
            return {}
        with self._lock:
            peers = [p for p in self._peers.values() if p.lost is None and p.writer.copying]
        return {peer_id(p.index): self._shm.held_by(p.writer) for p in peers}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
        for peer in peers:
            close_end(peer.conn, peer.sock, peer.writer)
        for pool in (self._shm, self._device):
            if pool is not None:
                pool.close()
        if self._selector is not None:
            self._selector.close()
        self._wakeup.close()
