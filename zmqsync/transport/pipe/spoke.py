"""A worker's end of the pipe transport: the child end of its ``multiprocessing.Pipe()``."""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from zmqsync.errors import TransportError
from zmqsync.protocol import Buffer
from zmqsync.transport.base import Borrows, Counted, SpokeTransport
from zmqsync.transport.cuda import handles
from zmqsync.transport.cuda.handles import DEVICE_IDS
from zmqsync.transport.ends import OpenEnd
from zmqsync.transport.pipe.buffers import BufferPool, owned
from zmqsync.transport.pipe.framing import socket_of
from zmqsync.transport.pipe.units import UnitReader
from zmqsync.transport.pipe.writer import LINGER_SECONDS, Outgoing, Writer, close_end
from zmqsync.transport.shm.borrowing import PeerBlocks, release_when_gone
from zmqsync.transport.shm.lent import lent_at
from zmqsync.transport.shm.records import (
    MAX_LIVE,
    Go,
    Keeps,
    Release,
    TakesDevice,
    encode,
)

__all__ = ["PipeSpoke"]

log = logging.getLogger("zmqsync.transport.pipe")


class PipeSpoke(OpenEnd, SpokeTransport, Borrows, Counted):
    """A worker's end: the child end of its ``multiprocessing.Pipe()``.

    If the hub closes or its process dies, the spoke says so once in the log, drops what
    it is asked to send and receives nothing; it does not raise (the receiver's own
    timeouts report a missing sender). Besides the contract it has the
    abilities it subclasses.
    """

    name = "pipe"

    def __init__(self, pipe: Connection) -> None:
        self._sock = socket_of(pipe, "the worker's pipe")
        self._conn = pipe
        #: Waits for the pipe to be readable: made once (``Connection.poll`` builds a
        #: selector at every call, four times the cost).
        self._poller = select.poll()
        self._poller.register(self._sock, select.POLLIN)
        self._writer = Writer(pipe, self._sock, "spoke")
        self._closed = False
        self._closed_event = threading.Event()
        self._hub_gone: str | None = None
        self._early: deque[list[Buffer]] = deque()  # read while waiting for our index
        self._pool = BufferPool()  # receive buffers, reused once no frame views them
        #: The hub's blocks, mapped read-only from the descriptors it passed (never
        #: evicted: the hub passes each one once).
        self._blocks = PeerBlocks(limit=None)
        #: The hub's units, read as they come: a unit it wrote in part waits for the rest
        #: (a learner stopped and continued), within each read's own deadline.
        self._units = UnitReader(self._sock, None, blocks=self._blocks, pool=self._pool)
        self._keeps = False  # told the hub it keeps each version mapped
        #: The GPU this worker told the hub its model lives on (device blocks come as
        #: tensors on it, and each is released only once the device is synchronized).
        self._device: Any = None
        #: Blocks let go of and not yet told to the hub, and whether a record that will
        #: tell it is queued: a version's chunks, let go of together, go in one record.
        self._releases: list[int] = []
        self._release_queued = False
        # Reentrant: a frame's finalizer may run inside it (a garbage collection).
        self._release_lock = threading.RLock()
        self._released = 0  # leases released
        self._unread = 0  # messages dropped: they lay in a device block it could not open
        self._release_records = 0  # ... in so many records
        #: The thread reading messages: releases made on it wait for its next write or
        #: read (an ack follows a version's last release at once, and takes it along).
        self._reader: int | None = None
        #: This worker's index, as the hub assigned it (``None`` until it has arrived).
        self.peer_index: int | None = None

    @property
    def endpoint(self) -> str:
        """A name for messages: the pipe has no address."""
        return "pipe://worker" if self.peer_index is None else f"pipe://worker-{self.peer_index}"

    def send_frames(self, frames: Sequence[Buffer], *, ack: bool = False) -> None:
        self._check_open()
        if self._hub_gone is None and self._writer.broken is not None:
            self._gone(self._writer.broken)
        # A small message (an ack) goes out on this thread when nothing waits before
        # it: the learner waits for it, and the writer thread's wake-up costs more.
        if not self._writer.message_now(frames):
            self._writer.put(Outgoing(owned(frames)[0]))

    def borrowed(self, buffers: Sequence[Buffer]) -> bool:
        # Its hub lends blocks whenever it can: a worker cannot tell which version came
        # through them, so each is let go of before its ack.
        return True

    def keep_versions(self) -> None:
        if not self._keeps:
            self._keeps = True
            self._writer.put(Outgoing(None, record=encode(Keeps())))

    def take_device(self, device: Any) -> None:
        lent = handles.lent_device(device)
        if lent is None or self._device == lent:
            return
        self._device = lent
        self._writer.put(Outgoing(None, record=encode(TakesDevice(handles.gpu_name(lent)))))

    def lends_tensors(self) -> bool:
        return not self._closed and self._hub_gone is None

    def lend_tensors(self, where: Any, layout: bytes) -> None:
        self._writer.put(Outgoing(None, record=encode(lent_at(where, layout))))

    def answer(self, version: int, epoch: int, ok: bool) -> None:
        record = encode(Go(version, epoch, ok))
        if not self._writer.put_now(record):  # the learner waits for it: no thread hop
            self._writer.put(Outgoing(None, record=record))

    def _refuse_device(self) -> None:
        """A device block could not be opened here: the hub is told this worker takes
        none (its versions then come through the host, and what it missed is repaired)."""
        self._device = None
        self._writer.put(Outgoing(None, record=encode(TakesDevice(handles.gpu_name(None)))))

    def _gone(self, why: str) -> None:
        if self._hub_gone is None:
            self._hub_gone = why
            log.warning("the sender's end of the pipe is gone (%s)", why)

    def _read(self, deadline: float | None, *, until_index: bool = False) -> list[Buffer] | None:
        """The next message, reading index assignments on the way; None on timeout (or,
        with ``until_index``, once an index has arrived)."""
        self._reader = threading.get_ident()
        while True:
            self._writer.flush_now()  # releases made since the last read go before it waits
            if self._hub_gone is not None:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._closed_event.wait(remaining)  # nothing will ever come: just time out
                return None
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                if not self._readable(remaining):
                    return None
                got = self._units.read()
            except (EOFError, OSError) as exc:
                self._gone(f"{type(exc).__name__}: {exc}" if str(exc) else "end of file")
                continue
            if got is None:
                continue  # part of a unit: the rest is waited for as the next one would be
            if got.index is not None:
                self.peer_index = got.index
                if until_index:
                    return None
                continue
            if got.refused is not None:
                self._refuse_device()
                continue
            if got.lent is not None:  # the hub's Ask or Written: the receiver's to act on
                return [encode(got.lent)]
            for block_id in got.unread:  # a message in a block it could not open: lost
                self._unread += 1
                self._release(block_id)
            if got.frames is None:
                continue  # a block's descriptor
            release_when_gone(got.views, self._release)
            return got.frames

    def _readable(self, timeout: float | None) -> bool:
        """Whether the pipe has something to read (or was closed) within ``timeout``."""
        try:
            return bool(self._poller.poll(None if timeout is None else timeout * 1000.0))
        except RuntimeError:  # another thread polls it (a misuse): wait as it would
            return self._conn.poll(timeout)

    def _release(self, block_id: int) -> None:
        """Tell the hub the frames of one message in ``block_id`` are gone: it may
        reuse the block once every lease on it is released. Releases made before the
        writer gets to the record go with it."""
        if self._closed:
            return
        if block_id >= DEVICE_IDS and self._device is not None:
            # The copies out of it may still be queued on the device: they end first.
            handles.IPC.synchronize(self._device)
        with self._release_lock:
            self._releases.append(block_id)
            if self._release_queued:
                return
            self._release_queued = True
        # Made on the reading thread, it goes with that thread's next write (the ack) or
        # read: no wake-up of the writer's thread. Made elsewhere (a sink's frames let go
        # of later), it goes now.
        later = threading.get_ident() == self._reader
        if not self._writer.put(Outgoing(None, make=self._release_record), wake=not later):
            with self._release_lock:
                self._release_queued = False  # the next release tries again

    def _release_record(self) -> bytes:
        """The record of every release made so far (on the writer's thread)."""
        with self._release_lock:
            ids, self._releases = self._releases, []
            if len(ids) > MAX_LIVE:  # the rest in the next record
                self._releases[:0] = ids[MAX_LIVE:]
                del ids[MAX_LIVE:]
            more = self._release_queued = bool(self._releases)
            self._released += len(ids)
            self._release_records += 1
        if more and not self._writer.put(Outgoing(None, make=self._release_record)):
            with self._release_lock:
                self._release_queued = False
        return encode(Release(tuple(ids)))

    def recv_frames(self, timeout: float | None) -> list[Buffer] | None:
        self._check_open()
        if self._early:
            return list(self._early.popleft())
        deadline = None if timeout is None else time.monotonic() + timeout
        frames = self._read(deadline)
        return None if frames is None else list(frames)

    def wait_index(self, timeout: float) -> int:
        """Wait for the hub to assign this worker's index and return it.

        Raises :class:`TransportError` if none arrives within ``timeout`` seconds.
        """
        self._check_open()
        deadline = time.monotonic() + timeout
        while self.peer_index is None:
            if time.monotonic() >= deadline or self._hub_gone is not None:
                why = f" (the pipe broke: {self._hub_gone})" if self._hub_gone else ""
                raise TransportError(
                    f"no worker index arrived on the pipe within {timeout:g}s{why}: create the "
                    "sender (init_on_sender with these pipes) first, or pass worker_idx="
                )
            frames = self._read(deadline, until_index=True)
            if frames is not None:
                self._early.append(frames)
        return self.peer_index

    def counters(self) -> dict[str, int]:
        """``dropped_sends``: messages this spoke dropped (the hub gone, or not
        reading); ``releases``: leases on the hub's blocks it released, in so many
        ``release_records``; ``unread_device``: messages it dropped because they lay in a
        device block it could not open (each one's version is repaired)."""
        with self._release_lock:
            return {
                "dropped_sends": self._writer.dropped,
                "releases": self._released,
                "release_records": self._release_records,
                "unread_device": self._unread,
            }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closed_event.set()
        # Its last words (a receiver's goodbye) reach the learner before the pipe ends,
        # so that a normal shutdown is not taken for a crash; bounded, never a hang.
        self._writer.drain(LINGER_SECONDS)
        close_end(self._conn, self._sock, self._writer)
        self._blocks.clear()
