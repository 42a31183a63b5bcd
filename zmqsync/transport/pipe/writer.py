"""Writing one pipe end's messages, in order, on a thread of its own.

The caller never waits on the peer: a peer that does not read (busy, or dead with its
end of the pipe still held open by some other process) leaves messages queued: the
chunks of a version are dropped when a newer one starts, the rest is bounded by
:data:`MAX_QUEUED`.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Final, cast

from zmqsync.protocol import Buffer
from zmqsync.transport.base import Stream
from zmqsync.transport.cuda.handles import DEVICE_IDS
from zmqsync.transport.pipe.framing import (
    message_head,
    shutdown,
    write_block,
    write_device_block,
    write_lease,
    write_message,
)
from zmqsync.transport.shm.blocks import BlockPool, Ref
from zmqsync.transport.shm.lending import lease_of
from zmqsync.transport.shm.records import Lease, encode

__all__ = ["Outgoing", "Writer", "close_end"]

log = logging.getLogger("zmqsync.transport.pipe")

#: Control messages queued for one peer before new ones are dropped. Weights never
#: pile up (a newer version replaces a queued one); this bounds everything else.
MAX_QUEUED: Final = 1024
#: A version for a worker that has not released the block of its previous one waits up
#: to this long for it (meanwhile a newer version replaces it in the queue), then goes.
RELEASE_PATIENCE: Final = 1.0
#: How long close() waits for a writer thread after shutting its socket down.
WRITER_JOIN_SECONDS: Final = 2.0
#: How long an idle writer sleeps before it looks again (stop() wakes it sooner).
_IDLE_SECONDS: Final = 1.0
#: Records at most this large may be written on the caller's thread (``put_now``).
_RECORD_NOW_MAX: Final = 4096
#: Control records queued before one written on the caller's thread that go with it, at
#: most (more, and it waits for the writer thread).
_RECORDS_NOW_MAX: Final = 8
#: multiprocessing's length prefix of a message under 2 GiB.
_LENGTH_PREFIX: Final = struct.Struct("!i")
#: How long closing a worker's end lets its last small messages (a goodbye) reach the
#: pipe: bounded, so closing never waits on a learner that stopped reading.
LINGER_SECONDS: Final = 0.5


def _control_bytes(item: Outgoing) -> bytes:
    """What the writer thread puts on the pipe for a queued control record."""
    if item.raw:
        return item.raw
    return _framed(item.record if item.make is None else item.make())


def _framed(record: bytes) -> bytes:
    """``record`` as ``Connection.send_bytes`` writes it: its length, then its bytes."""
    return _LENGTH_PREFIX.pack(len(record)) + record


@dataclass
class Outgoing:
    frames: list[Buffer | Ref] | None  # None: ``record`` alone (a control record)
    stream: Stream | None = None
    record: bytes = b""
    keep: Any = None  # what keeps the shared-memory blocks it names lent
    #: Makes the control record when it is written, not when queued (what was added
    #: meanwhile rides along: the releases of one version's chunks go as one record).
    make: Callable[[], bytes] | None = None
    #: Bytes to write as they are (the rest of a record :meth:`Writer.put_now` began).
    raw: bytes = b""
    #: The peer forgets the host blocks it maps once it reads this record (the hub's
    #: word that a version is in its lent tensors): blocks named later are handed anew.
    unmaps: bool = False

    @property
    def lent(self) -> bool:
        return self.frames is not None and any(isinstance(f, Ref) for f in self.frames)


class Writer:
    """Writes one connection's outgoing messages; leases the blocks a message names to
    the peer (``pool``; device blocks: ``devices``) as it writes it."""

    def __init__(
        self,
        conn: Connection,
        sock: socket.socket,
        name: str,
        pool: BlockPool | None = None,
        devices: BlockPool | None = None,
    ) -> None:
        self._conn = conn
        self._sock = sock
        self._pool = pool
        self._devices = devices
        #: The GPU the peer's model lives on, as it said (a UUID digest): device blocks
        #: of that GPU are leased to it; of any other, their bytes go through the pipe.
        self.device: bytes | None = None
        self._known: set[int] = set()  # blocks whose descriptor the peer has
        self._unreleased = 0  # leases written and not released yet
        self._held_since: float | None = None
        #: The peer keeps each version mapped until the next is in (it said so): its
        #: unreleased leases are the version it holds, no reason to wait.
        self.keeps_versions = False
        #: Leases written for the version last started in shared memory: a peer that
        #: keeps versions and took that one in holds these and none older.
        self._version_leases = 0
        #: The version being written goes through the pipe, copied: the peer keeps
        #: versions and has not taken in the last one leased (stopped, stuck), so a lease
        #: would pin one more block, and soon every block, for every worker.
        self.copying = False
        #: Versions sent to this peer copied, for that reason.
        self.copies = 0
        #: When a lease was last written, and when the peer was last heard from: a peer
        #: heard from since is alive and reading (an old view it keeps pins a block; it
        #: is no reason to stop leasing to it).
        self._leased_at = 0.0
        self._heard_at = 0.0
        self._queue: deque[Outgoing] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._writing = False  # an item taken off the queue is being written
        #: Why writing failed (the pipe broke), or None while it works.
        self.broken: str | None = None
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"zmqsync-pipe-{name}", daemon=True)
        self._thread.start()

    def put(self, item: Outgoing, *, wake: bool = True) -> bool:
        """Queue ``item`` (or write a lease at once, see :meth:`_leases_now`); False if
        it was dropped. ``wake=False`` leaves the writer's thread asleep: the caller
        writes soon on its own thread (which takes the queued records along) or calls
        :meth:`wake` (a worker's releases, made on its receiving thread just before its
        ack: the thread's wake-up would cost more than the release)."""
        with self._cond:
            if self._stopping or self.broken is not None:
                self.dropped += 1
                return False
            if item.stream is Stream.START:
                # A newer version starts: the chunks of older ones still waiting are dead
                # weight (a receiver drops a version whose stream a newer one cut).
                kept = deque(m for m in self._queue if m.stream is None)
                self.dropped += len(self._queue) - len(kept)
                self._queue = kept
            elif len(self._queue) >= MAX_QUEUED:
                self.dropped += 1
                return False
            if self._queue or self._writing or not self._leases_now(item):
                self._queue.append(item)
                if wake:
                    self._cond.notify()
                return True
            self._writing = True  # this thread writes it; the writer's thread waits
        try:
            self._lease_now(item)
        finally:
            with self._cond:
                self._writing = False
                if self._queue:
                    self._cond.notify_all()
        return True

    def wake(self) -> None:
        """Have the writer's thread write what is queued (see ``put(wake=False)``)."""
        with self._cond:
            if self._queue:
                self._cond.notify()

    def flush_now(self) -> None:
        """Write the control records queued (a worker's releases) on the caller's
        thread if the pipe takes them at once, else :meth:`wake` the writer's thread for
        them: a receiving thread about to read lets its releases go without waking the
        writer's thread (a thread switch, and the GIL passed there and back, per chunk)."""
        with self._cond:
            if not self._queue:
                return
        if not self._write_now(b""):
            self.wake()

    def _leases_now(self, item: Outgoing) -> bool:
        """Whether ``item`` may be written on the caller's thread, the writer being idle
        (call holding the condition): a lease on host blocks the peer has, with little
        inline, that need not wait for the peer's releases; then its version's leases
        start here, as :meth:`_next` would start them. Saves the writer thread's wake-up
        between the learner's write of a chunk and the worker's read of it."""
        frames = item.frames
        if frames is None or not item.lent:
            return False
        inline = 0
        for f in frames:
            if isinstance(f, Ref):
                if f.block.id >= DEVICE_IDS or f.block.id not in self._known:
                    return False
            else:
                inline += memoryview(f).nbytes
        if inline > _RECORD_NOW_MAX:
            return False
        if item.stream is Stream.START:
            if self._behind():
                return False  # the writer's thread gives the peer its patience
            self.copying = False
            self._version_leases = 0
            self._held_since = None
        return not self.copying

    def _lease_now(self, item: Outgoing) -> None:
        """Write lease ``item`` without blocking (see :meth:`_leases_now`): what the pipe
        does not take now goes first in the queue, for the writer's thread."""
        frames = item.frames
        assert frames is not None
        try:
            lease = self._lease(frames)
        except (OSError, ValueError) as exc:  # as the writer's thread would have failed
            with self._cond:
                self.broken = f"{type(exc).__name__}: {exc}"
                self._queue.clear()
            return
        if lease is None:
            return
        data = b"".join(
            [_framed(encode(lease)), *(memoryview(f) for f in frames if not isinstance(f, Ref))]
        )
        sent = self._send_now(data)
        if sent < len(data):
            with self._cond:
                self._queue.appendleft(Outgoing(None, raw=data[sent:]))

    def put_now(self, record: bytes, *, unmaps: bool = False) -> bool:
        """Write a small control ``record`` on the caller's thread if nothing is being
        written and the pipe takes it at once (what it does not take is queued, in
        order); False when it wrote nothing: then :meth:`put` it. Saves the writer
        thread's wake-up on a record the peer waits for (a handshake's turn). Control
        records queued before it and not taken yet (a worker's releases) go with it, in
        order; anything else queued makes it wait its turn."""
        if len(record) > _RECORD_NOW_MAX:
            return False
        return self._write_now(_framed(record), unmaps)

    def message_now(self, frames: Sequence[Buffer]) -> bool:
        """:meth:`put_now` for a small message of plain ``frames`` (an ack): the bytes
        :func:`write_message` and the frames would put on the pipe."""
        if sum(memoryview(f).nbytes for f in frames) > _RECORD_NOW_MAX:
            return False
        header, lengths = message_head(frames)
        return self._write_now(
            b"".join((_framed(header), _framed(lengths), *(memoryview(f) for f in frames)))
        )

    def _write_now(self, data: bytes, unmaps: bool = False) -> bool:
        with self._cond:
            if self._stopping or self.broken is not None or self._writing:
                return False
            before = b""
            queued: list[Outgoing] = []
            if self._queue:
                queued = list(self._queue)
                if (
                    len(queued) > _RECORDS_NOW_MAX
                    or any(m.frames is not None for m in queued)
                    or not self._has_room()
                ):
                    return False  # the caller queues it (bounded), behind them
                self._queue.clear()
                # A record made now may queue more (a release record names at most so
                # many blocks): those follow, as the writer would have sent them.
                before = b"".join(_control_bytes(m) for m in queued)
            data = before + data
            sent = self._send_now(data)
            if any(m.unmaps for m in queued):
                self._forget_known()  # off the queue: written now, or first thing (raw)
            if sent < len(before):  # not even what was queued: the caller queues its own
                self._queue.appendleft(Outgoing(None, raw=before[sent:]))
                self._cond.notify()
                return False
            if sent == 0:
                return False  # the peer is not reading: the caller queues it (bounded)
            if sent < len(data):
                self._queue.appendleft(Outgoing(None, raw=data[sent:]))
                self._cond.notify()
            if unmaps:
                self._forget_known()
            return True

    def _forget_known(self) -> None:
        """The peer forgets the host blocks it maps once it reads what was just written
        (call holding the condition): hand each block to it again when next leased."""
        self._known = {b for b in self._known if b >= DEVICE_IDS}

    def _has_room(self) -> bool:
        """Whether the pipe takes bytes now (so queued records are not taken off the
        queue only to be put back, merged, while the peer does not read)."""
        poller = select.poll()
        poller.register(self._sock, select.POLLOUT)
        return bool(poller.poll(0))

    def _send_now(self, data: bytes) -> int:
        """Write what the pipe takes of ``data`` at once; how many bytes it took."""
        try:
            return self._sock.send(data, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return 0  # the peer is not reading: the thread waits for it
        except OSError:
            return 0  # broken: the thread finds out, and says so

    def _next(self) -> Outgoing | None:
        with self._cond:
            if self._writing:
                self._writing = False  # the item taken before is written
                self._cond.notify_all()
            while not self._stopping:
                if not self._queue or self._writing:  # writing: another thread is (put)
                    self._cond.wait(_IDLE_SECONDS)  # stop() notifies; this bounds a missed one
                    continue
                head = self._queue[0]
                starts = head.stream is Stream.START
                if starts and head.lent and self._behind():
                    # The peer still reads its previous version in place: let it finish
                    # (a newer version may replace this one meanwhile) rather than pin
                    # one more block. A peer that never releases only delays it.
                    now = time.monotonic()
                    if self._held_since is None:
                        self._held_since = now
                    remaining = self._held_since + RELEASE_PATIENCE - now
                    if remaining > 0:
                        self._cond.wait(remaining)
                        continue
                    # One that keeps versions holds a version it has not taken in:
                    # this one goes copied (another peer goes on, leasing one more).
                    self.copying = self.keeps_versions
                    self.copies += int(self.copying)
                elif starts:
                    self.copying = False
                if starts and not self.copying:
                    self._version_leases = 0
                self._held_since = None
                self._writing = True
                return self._queue.popleft()
            return None

    def _behind(self) -> bool:
        """Whether the peer still holds leases it should have let go of by now (call
        holding the condition): any, for a peer that copies each version out of its
        block; for one that keeps versions mapped, any older than the version last
        leased to it (it has not taken that one in yet)."""
        if self.keeps_versions:
            return self._unreleased > self._version_leases and self._heard_at < self._leased_at
        return self._unreleased > 0

    def heard(self) -> None:
        """The peer sent a message (it is not stopped)."""
        with self._cond:
            self._heard_at = time.monotonic()
            self._wake_if_held()

    def released(self) -> None:
        """The peer released one lease."""
        with self._cond:
            self._unreleased = max(0, self._unreleased - 1)
            self._wake_if_held()

    def _wake_if_held(self) -> None:
        """Wake the thread if it holds a version back for the peer's release (call holding
        the condition). Only then: the hub hears from each peer twice a version (an ack, a
        release), and waking an idle writer each time costs the caller a thread switch
        while it holds the interpreter lock."""
        if self._held_since is not None:
            self._cond.notify()

    def _run(self) -> None:
        try:
            while (item := self._next()) is not None:
                if item.frames is None:
                    if item.raw:
                        self._sock.sendall(item.raw)
                    else:
                        self._conn.send_bytes(item.record if item.make is None else item.make())
                    if item.unmaps:
                        with self._cond:
                            self._forget_known()
                    continue
                frames = item.frames
                if any(_on_device(f) and f.block.uuid != self.device for f in frames):  # type: ignore[union-attr]
                    frames = [host_bytes(f) if _on_device(f) else f for f in frames]  # type: ignore[arg-type]
                lent = any(isinstance(f, Ref) for f in frames)
                if lent and self.copying:
                    frames = list(_copied(frames))
                    item = None  # its blocks are free to go
                    write_message(self._conn, frames)  # type: ignore[arg-type]
                elif lent:
                    lease = self._lease(frames)
                    if lease is None:
                        continue
                    write_lease(self._conn, lease)
                else:
                    write_message(self._conn, frames)  # type: ignore[arg-type]
                for frame in frames:
                    if self._stopping:
                        return  # closing: the peer sees the pipe end, not half a message
                    if not isinstance(frame, Ref):
                        self._sock.sendall(frame)
                # Written: let go of it now (a pooled buffer is free once nobody holds it).
                item = frames = frame = None  # type: ignore[assignment]
        except (OSError, EOFError, ValueError) as exc:
            # EPIPE/ECONNRESET: the peer is gone; ValueError/OSError(EBADF): closed by us.
            with self._cond:
                self.broken = f"{type(exc).__name__}: {exc}"
                self._queue.clear()

    def _lease(self, frames: list[Buffer | Ref]) -> Lease | None:
        """Count a lease to the peer on each block the message names, pass it the
        descriptor of any block it has not seen, and return the lease to write. None:
        drop the message."""
        blocks = {f.block.id: f.block for f in frames if isinstance(f, Ref)}
        leased: list[Any] = []
        for block in blocks.values():
            pool = self._pool_of(block.id)
            if not pool.lease(block, self):  # retired: cannot be, while a frame views it
                for b in leased:
                    self._pool_of(b.id).release(b.id, self)
                self.dropped += 1
                return None
            leased.append(block)
        with self._cond:
            self._unreleased += 1
            self._version_leases += 1
            self._leased_at = time.monotonic()
        for block in blocks.values():
            if block.id not in self._known:
                if block.id >= DEVICE_IDS:
                    write_device_block(self._conn, block.id, cast(Any, block).handle_for_peer())
                else:
                    write_block(self._conn, self._sock, block.id, block.fd)
                self._known.add(block.id)
        live = [i for pool in (self._pool, self._devices) if pool for i in pool.live_ids()]
        # The peer maps blocks by descriptor, never through /proc: no pid.
        return lease_of(frames, pid=0, live=live)[0]

    def _pool_of(self, block_id: int) -> BlockPool:
        pool = self._devices if block_id >= DEVICE_IDS else self._pool
        assert pool is not None
        return pool

    def drain(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for everything queued to be written (False:
        it was not, or the pipe broke)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            # Looked at every few ms: a write on a caller's thread (put) ends unannounced.
            while self.broken is None and (self._queue or self._writing):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.005))
            return self.broken is None and not (self._queue or self._writing)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._cond.notify_all()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _copied(frames: list[Buffer | Ref]) -> list[Buffer | Ref]:
    """``frames`` with each place in a block replaced by a private copy of its bytes: a
    write that blocks on a peer that does not read holds no block meanwhile."""
    return [
        f if not isinstance(f, Ref) else host_bytes(f) if _on_device(f) else _bytes_of(f)
        for f in frames
    ]


def _bytes_of(ref: Ref) -> bytes:
    return ref.block.array[ref.offset : ref.offset + ref.length].tobytes()


def _on_device(frame: Any) -> bool:
    """Whether ``frame`` is a place in a device block."""
    return isinstance(frame, Ref) and frame.block.id >= DEVICE_IDS


def host_bytes(ref: Ref) -> bytes:
    """The bytes of a place in a device block, copied to the host."""
    view: Any = ref.block.array[ref.offset : ref.offset + ref.length]
    return bytes(view.cpu().numpy().tobytes())


def close_end(conn: Connection, sock: socket.socket, writer: Writer) -> None:
    """Close one pipe end without ever waiting on its peer."""
    writer.stop()
    shutdown(sock)  # wakes a writer blocked on a peer that does not read
    if writer.join(WRITER_JOIN_SECONDS):
        conn.close()
    else:  # pragma: no cover - a socket shutdown always ends a blocked write on Linux
        log.warning(
            "a pipe writer did not stop within %ss; leaving its pipe open", WRITER_JOIN_SECONDS
        )
