"""Transport over multiprocessing pipes: one duplex pipe per worker, no sockets to bind.

The hub holds one end of each worker's ``multiprocessing.Pipe()`` (``duplex=True``); the
worker holds the other. A message travels as two records written with
``Connection.send_bytes`` (a header: magic and frame count; then every frame's length),
followed by the frames' bytes, raw, on the same socket. ``Connection.send``/``recv`` are
never used: they pickle, and no pickle travels on zmqsync's data path. The frame bytes
bypass ``Connection.recv_bytes``, which reads a large record in small chunks through an
``io.BytesIO`` (three copies; 0.75 GB/s for 16 MiB here): the reader allocates each
message once and fills it with ``recv_into`` (2.5 GB/s).

Writes happen on a thread per connection, so ``send_frames`` never blocks on a worker that
is busy, or dead with its end of the pipe still held open by some other process. A
version waiting to be written is replaced by a newer one (a receiver only wants the
newest). ``send_frames`` copies what it is given once (shared by every worker's queue), so
the caller may change its tensors as soon as it returns; ``bytes`` and read-only buffers
(a sender's snapshot), which never change, are not copied. Large copies and large receive buffers
come from a small pool and are reused once nothing views them: fresh memory costs a page
fault per page, which on some VMs is most of a copy's time.

Large frames (64 KiB and up) skip the socket where the platform has ``memfd`` (Linux):
the hub copies them once into a shared-memory block from :class:`~zmqsync.transport._shm
.ShmPool` (or sends a read-only frame that already lies in one, such as a sender's
snapshot, as it is), passes each worker the block's descriptor once (``SCM_RIGHTS`` on
the pipe's Unix socket), and then only says where each frame lies (a ``ZSP3`` message).
The worker maps the block read-only and releases it (a ``ZSPR`` record) once its frames
are garbage; the hub rewrites a block only after that. ``PipeHub(shared_memory=False)``
keeps every byte on the socket.

A worker learns its index from the hub: the first record on each pipe assigns it
(:attr:`PipeSpoke.peer_index`), so ``init_on_worker(pipe=..., model=...)`` needs no
``worker_idx``.

Example::

    parent, child = multiprocessing.get_context("spawn").Pipe()
    hub = PipeHub([parent])                 # learner
    spoke = PipeSpoke(child)                # worker process (child end passed at spawn)

Close the learner's copy of each child end once the worker has started: then a worker
that dies is seen at once (end of file) instead of at the next send's timeout.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Final

import numpy as np

from zmqsync.errors import TransportClosed, TransportError
from zmqsync.protocol import MAX_BUFFERS, Buffer, Kind, peek_kind, starts_version
from zmqsync.transport._shm import SHM_AVAILABLE, Block, ShmPool
from zmqsync.transport._shm import Ref as _Ref
from zmqsync.transport._shm import immutable as _immutable
from zmqsync.transport.base import HubTransport, Incoming, PeerId, SpokeTransport

__all__ = ["PipeHub", "PipeSpoke", "peer_id"]

log = logging.getLogger("zmqsync.transport.pipe")

#: A message's first record: magic, then the number of frames. The second record holds
#: every frame's length (``_LENGTH`` each); then come the frames' bytes, back to back.
_HEADER: Final = struct.Struct("<4sI")
_LENGTH: Final = struct.Struct("<Q")
_MESSAGE: Final = b"ZSP2"
#: The record that tells a worker its index (the count field carries the index).
_ASSIGN: Final = b"ZSPI"
#: A message some of whose frames lie in shared-memory blocks: its second record holds
#: ``_REF`` per frame (length, block id or -1 when the bytes follow inline, offset).
_SHARED: Final = b"ZSP3"
_REF: Final = struct.Struct("<QqQ")
#: Hub to worker: block ``count`` follows, its file descriptor attached to one byte.
_BLOCK: Final = b"ZSPB"
#: Hub to worker: block ``count`` is gone; forget its mapping.
_UNMAP: Final = b"ZSPU"
#: Worker to hub: done with one message that named block ``count``.
_RELEASE: Final = b"ZSPR"
#: Frames per message: the protocol's buffer limit plus the header and schema frames.
MAX_FRAMES: Final = MAX_BUFFERS + 2
#: What a hub accepts in one message from a worker. Workers send acks and requests (a
#: few KiB); a bigger message is a confused peer, refused before it is allocated.
DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
#: Control messages queued for one peer before new ones are dropped. Weights never
#: pile up (a newer version replaces a queued one); this bounds everything else.
MAX_QUEUED: Final = 1024
#: The frames of one message follow its header at once. A peer silent for this long in
#: the middle of a message is stuck (stopped, or confused) and its pipe is given up: the
#: stream cannot be resynchronised, and the hub's reader must not wait on it forever.
STALL_SECONDS: Final = 10.0
#: A version for a worker that has not released the block of its previous one waits up
#: to this long for it (meanwhile a newer version replaces it in the queue), then goes.
RELEASE_PATIENCE: Final = 1.0
#: How long close() waits for a writer thread after shutting its socket down.
WRITER_JOIN_SECONDS: Final = 2.0


#: Received frames at least this large are handed out as views of a pooled buffer.
_VIEW_MIN_BYTES: Final = 64 * 1024
#: Messages at least this large are copied into (and read into) reused buffers.
POOL_MIN_BYTES: Final = 1024 * 1024
#: Free buffers a pool keeps for reuse.
POOL_KEEP: Final = 2


class _BufferPool:
    """Large buffers reused from message to message.

    Fresh memory costs a page fault per page when first written: on the VMs these
    benchmarks ran on, filling a fresh 128 MiB buffer took 119 ms, a reused one 7 ms.
    A buffer is lent with the objects that view it; once every one of them is garbage
    (``weakref.finalize``), nothing can read it any more and it is free again.
    """

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def lend(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes``: call :meth:`watch` on everything that views it."""
        if nbytes < POOL_MIN_BYTES:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            for i, buf in enumerate(self._free):
                if nbytes <= buf.nbytes <= 2 * nbytes:
                    del self._free[i]
                    return buf
        return np.empty(nbytes, dtype=np.uint8)

    def watch(self, buf: np.ndarray, holders: Sequence[object]) -> None:
        """Give ``buf`` back once every object in ``holders`` has been collected."""
        if buf.nbytes < POOL_MIN_BYTES or not holders:
            return
        left = [len(holders)]
        lock = threading.Lock()

        def one_gone() -> None:
            with lock:
                left[0] -= 1
                done = left[0] == 0
            if done:
                self._give_back(buf)

        for holder in holders:
            weakref.finalize(holder, one_gone)

    def _give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < POOL_KEEP:
                self._free.append(buf)


def peer_id(index: int) -> PeerId:
    """The hub's peer id of the worker at ``index``: ``b"pipe:3"``."""
    return b"pipe:%d" % index


def _owned(
    frames: Sequence[Buffer | _Ref], pool: _BufferPool | None = None
) -> tuple[list[Buffer | _Ref], Any]:
    """``frames`` safe to keep after the caller changes its memory: copied once into one
    buffer (from ``pool``, when given). Returns the frames and that buffer (or None)."""
    mutable = [i for i, f in enumerate(frames) if not _immutable(f)]
    if not mutable:
        return list(frames), None
    sizes = [memoryview(frames[i]).nbytes for i in mutable]  # type: ignore[arg-type]
    total = sum(sizes)
    buf = pool.lend(total) if pool is not None else np.empty(total, dtype=np.uint8)
    out = list(frames)
    offset = 0
    for i, n in zip(mutable, sizes, strict=True):
        view = buf[offset : offset + n]
        np.copyto(view, np.frombuffer(frames[i], dtype=np.uint8))  # type: ignore[arg-type]
        out[i] = view.data
        offset += n
    return out, buf


def _socket_of(conn: Connection, what: str) -> socket.socket:
    """A second handle on the pipe's socket, to shut it down from another thread.

    Shutting a socket down wakes a thread blocked writing to it; closing a file
    descriptor another thread may still use would not (and risks hitting a reused fd).
    """
    if not isinstance(conn, Connection) or not (conn.readable and conn.writable):
        raise ValueError(
            f"{what} must be one end of multiprocessing.Pipe(duplex=True); got {conn!r}"
        )
    try:
        fd = conn.fileno()
    except OSError as exc:
        raise ValueError(f"{what} is closed: pass an open pipe end") from exc
    dup = os.dup(fd)
    try:
        return socket.socket(fileno=dup)
    except OSError as exc:
        os.close(dup)
        raise ValueError(
            f"{what} is not a socket pair: use multiprocessing.Pipe(duplex=True) on a POSIX system"
        ) from exc


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _recv_record(conn: Connection, max_bytes: int) -> bytes:
    """One record; EOFError/OSError when the pipe broke or the peer is stuck mid-message."""
    if not conn.poll(STALL_SECONDS):
        raise OSError(f"the peer stopped in the middle of a message for {STALL_SECONDS:g}s")
    return conn.recv_bytes(max_bytes)


def _recv_raw(
    conn: Connection, sock: socket.socket, nbytes: int, pool: _BufferPool | None = None
) -> Any:
    """``nbytes`` raw bytes, read straight into one buffer (from ``pool``, if given)."""
    buf: Any = pool.lend(nbytes)[:nbytes] if pool is not None else bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        if not conn.poll(STALL_SECONDS):
            raise OSError(f"the peer stopped in the middle of a message for {STALL_SECONDS:g}s")
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the pipe closed in the middle of a message")
        got += n
    return buf


#: What :func:`_read_message` returns: the record's magic, its count field, the frames,
#: and, per shared-memory block the frames lie in, the frames that view it.
_Read = tuple[bytes, int, list[Buffer], dict[int, list[np.ndarray]]]


def _recv_block(
    conn: Connection, sock: socket.socket, block_id: int, blocks: dict[int, np.ndarray]
) -> None:
    """Map the block whose descriptor rides on the next byte, read-only."""
    if not conn.poll(STALL_SECONDS):
        raise OSError(f"the peer stopped before sending block {block_id}")
    data, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not data:
        raise EOFError(f"the pipe closed before block {block_id}")
    if not fds:
        raise OSError(f"block {block_id} came without its file descriptor")
    fd = fds[0]
    try:
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
    finally:
        os.close(fd)
    blocks[block_id] = (
        np.frombuffer(mapped, dtype=np.uint8) if mapped is not None else np.empty(0, np.uint8)
    )


def _read_message(
    conn: Connection,
    sock: socket.socket,
    max_message_bytes: int | None,
    pool: _BufferPool | None = None,
    blocks: dict[int, np.ndarray] | None = None,
) -> _Read:
    """The next record, whose header must be readable now.

    Frames are views of one buffer that the caller owns, or of shared-memory ``blocks``
    (a worker's, filled by ``_BLOCK`` records; ``None`` on the hub, which takes none).
    Raises EOFError or OSError when the pipe broke or carries bytes that are not ours
    (the stream is then lost: it cannot be resynchronised).
    """
    head = conn.recv_bytes(_HEADER.size)
    if len(head) != _HEADER.size:
        raise OSError(f"a pipe header is {_HEADER.size} bytes; got {len(head)}")
    magic, count = _HEADER.unpack(head)
    if magic in (_ASSIGN, _RELEASE, _UNMAP):
        return magic, count, [], {}
    if magic not in (_MESSAGE, _SHARED, _BLOCK) or (magic != _MESSAGE and blocks is None):
        raise OSError(f"bad pipe record magic {magic!r}: is someone else writing on this pipe?")
    if magic == _BLOCK:
        assert blocks is not None
        _recv_block(conn, sock, count, blocks)
        return magic, count, [], {}
    if count > MAX_FRAMES:
        raise OSError(f"a message of {count} frames exceeds the limit of {MAX_FRAMES}")
    entry = _LENGTH if magic == _MESSAGE else _REF
    table = _recv_record(conn, count * entry.size)
    if len(table) != count * entry.size:
        raise OSError(f"the frame table of {count} frames takes {count * entry.size} bytes")
    if magic == _MESSAGE:
        refs = [(n, -1, 0) for (n,) in _LENGTH.iter_unpack(table)]
    else:
        refs = list(_REF.iter_unpack(table))
    sizes = [n for n, block, _ in refs if block < 0]
    total = sum(sizes)
    if max_message_bytes is not None and total > max_message_bytes:
        raise OSError(f"a message of {total} bytes exceeds the limit of {max_message_bytes}")
    inline = iter(_inline_frames(_recv_raw(conn, sock, total, pool), sizes, pool))
    frames: list[Any] = []  # buffers; views of shared blocks stay numpy arrays (see lent())
    shared: dict[int, list[np.ndarray]] = {}
    for n, block_id, offset in refs:
        if block_id < 0:
            frames.append(next(inline))
            continue
        mapped = blocks.get(block_id) if blocks is not None else None
        if mapped is None or offset + n > mapped.nbytes:
            raise OSError(
                f"a frame names bytes {offset}..{offset + n} of block {block_id}, "
                "which this worker does not have"
            )
        view = mapped[offset : offset + n]
        shared.setdefault(block_id, []).append(view)
        frames.append(view)
    return magic, count, frames, shared


def _inline_frames(raw: Any, sizes: list[int], pool: _BufferPool | None) -> list[Buffer]:
    """Split one received buffer into its frames."""
    total = sum(sizes)
    frames: list[Buffer] = []
    offset = 0
    if pool is None or total < POOL_MIN_BYTES:
        view = memoryview(raw)
        for n in sizes:
            frames.append(view[offset : offset + n])
            offset += n
        return frames
    # A pooled buffer: small frames are copied out; large ones are views of the buffer
    # (numpy arrays, which can be watched), and it is reused once all of them are gone.
    large = []
    for n in sizes:
        if n >= _VIEW_MIN_BYTES:
            frame = raw[offset : offset + n]
            large.append(frame)
            frames.append(frame)
        else:
            frames.append(raw[offset : offset + n].tobytes())
        offset += n
    pool.watch(raw.base if raw.base is not None else raw, large)
    return frames


@dataclass
class _Outgoing:
    frames: list[Buffer | _Ref] | None  # None: ``record`` alone (a control record)
    kind: Kind | None = None
    record: bytes = b""
    keep: Any = None  # what keeps the shared-memory blocks it names lent
    first: bool = False  # the first chunk of a version

    @property
    def shared(self) -> bool:
        return self.frames is not None and any(isinstance(f, _Ref) for f in self.frames)


class _Writer:
    """Writes one connection's outgoing messages, in order, on a thread of its own.

    The caller never waits on the peer: a peer that does not read leaves messages queued
    (the chunks of a version dropped when a newer one starts, the rest bounded by
    MAX_QUEUED).
    """

    def __init__(
        self, conn: Connection, sock: socket.socket, name: str, shm: ShmPool | None = None
    ) -> None:
        self._conn = conn
        self._sock = sock
        self._shm = shm
        self._known: set[int] = set()  # blocks whose descriptor the peer has
        self._unreleased = 0  # shared-memory messages written and not released yet
        self._held_since: float | None = None
        self._queue: deque[_Outgoing] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        #: Why writing failed (the pipe broke), or None while it works.
        self.broken: str | None = None
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"zmqsync-pipe-{name}", daemon=True)
        self._thread.start()

    def put(self, item: _Outgoing) -> bool:
        with self._cond:
            if self._stopping or self.broken is not None:
                self.dropped += 1
                return False
            if item.first:
                # A newer version starts: the chunks of older ones still waiting are dead
                # weight (a receiver drops a version whose stream a newer one cut).
                kept = deque(m for m in self._queue if m.kind is not Kind.WEIGHTS)
                self.dropped += len(self._queue) - len(kept)
                self._queue = kept
            elif len(self._queue) >= MAX_QUEUED:
                self.dropped += 1
                return False
            self._queue.append(item)
            self._cond.notify()
        return True

    def _next(self) -> _Outgoing | None:
        with self._cond:
            while not self._stopping:
                if not self._queue:
                    self._cond.wait(1.0)  # idle; stop() notifies, this bounds a missed one
                    continue
                head = self._queue[0]
                if self._unreleased and head.first and head.shared:
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
                self._held_since = None
                return self._queue.popleft()
            return None

    def released(self) -> None:
        """The peer let go of one shared-memory message."""
        with self._cond:
            self._unreleased = max(0, self._unreleased - 1)
            self._cond.notify()

    def _run(self) -> None:
        try:
            while (item := self._next()) is not None:
                if item.frames is None:
                    self._conn.send_bytes(item.record)
                    continue
                frames = item.frames
                if item.shared:
                    if not self._announce_blocks(frames):
                        continue
                    self._conn.send_bytes(_HEADER.pack(_SHARED, len(frames)))
                    self._conn.send_bytes(
                        b"".join(
                            _REF.pack(f.length, f.block.id, f.offset)
                            if isinstance(f, _Ref)
                            else _REF.pack(memoryview(f).nbytes, -1, 0)
                            for f in frames
                        )
                    )
                else:
                    self._conn.send_bytes(_HEADER.pack(_MESSAGE, len(frames)))
                    self._conn.send_bytes(
                        b"".join(_LENGTH.pack(memoryview(f).nbytes) for f in frames)  # type: ignore[arg-type]
                    )
                for frame in frames:
                    if self._stopping:
                        return  # closing: the peer sees the pipe end, not half a message
                    if not isinstance(frame, _Ref):
                        self._sock.sendall(frame)
                # Written: let go of it now (a pooled buffer is free once nobody holds it).
                item = frames = frame = None  # type: ignore[assignment]
        except (OSError, EOFError, ValueError) as exc:
            # EPIPE/ECONNRESET: the peer is gone; ValueError/OSError(EBADF): closed by us.
            with self._cond:
                self.broken = f"{type(exc).__name__}: {exc}"
                self._queue.clear()

    def _announce_blocks(self, frames: list[Buffer | _Ref]) -> bool:
        """Count the message as held by the peer in each block it names, and send the
        peer the descriptor of any block it has not seen. False: drop the message."""
        assert self._shm is not None
        blocks = {f.block.id: f.block for f in frames if isinstance(f, _Ref)}
        held: list[Block] = []
        for block in blocks.values():
            if not self._shm.hold(block, self):  # retired: cannot be, while a frame views it
                for b in held:
                    self._shm.release(b.id, self)
                self.dropped += 1
                return False
            held.append(block)
        with self._cond:
            self._unreleased += 1
        for block in blocks.values():
            if block.id not in self._known:
                self._conn.send_bytes(_HEADER.pack(_BLOCK, block.id))
                socket.send_fds(self._sock, [b"B"], [block.fd])
                self._known.add(block.id)
        return True

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._cond.notify_all()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _close_end(conn: Connection, sock: socket.socket, writer: _Writer) -> None:
    """Close one pipe end without ever waiting on its peer."""
    writer.stop()
    _shutdown(sock)  # wakes a writer blocked on a peer that does not read
    if writer.join(WRITER_JOIN_SECONDS):
        conn.close()
    else:  # pragma: no cover - a socket shutdown always ends a blocked write on Linux
        log.warning(
            "a pipe writer did not stop within %ss; leaving its pipe open", WRITER_JOIN_SECONDS
        )


@dataclass
class _Peer:
    index: int
    conn: Connection = field(repr=False)
    sock: socket.socket = field(repr=False)
    writer: _Writer = field(repr=False)
    lost: str | None = None


class PipeHub(HubTransport):
    """The learner's end: one duplex pipe per worker.

    Args:
        pipes: the learner's end of each worker's ``multiprocessing.Pipe()``; a sequence
            (worker ``i`` is ``pipes[i]``) or a mapping ``{worker_index: pipe_end}``.
            Each pipe must carry nothing but this hub's messages.
        max_message_bytes: the largest message accepted from a worker.
        shared_memory: send large frames through shared-memory blocks (Linux), written
            once and read by every worker in place, instead of through each pipe.

    Peer ids are ``b"pipe:<index>"`` (:func:`peer_id`). A worker whose pipe breaks (it
    exited or was killed) is counted in ``counters()["peers_lost"]``; sends to it are
    dropped, never raised.
    """

    name = "pipe"

    def __init__(
        self,
        pipes: Sequence[Connection] | Mapping[int, Connection],
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        shared_memory: bool = True,
    ) -> None:
        items: Iterable[tuple[int, Connection]] = (
            pipes.items() if isinstance(pipes, Mapping) else enumerate(pipes)
        )
        self._max_message_bytes = max_message_bytes
        self._peers: dict[PeerId, _Peer] = {}
        self._by_conn: dict[Connection, _Peer] = {}
        self._closed = False
        self._dropped = 0
        self._lost = 0
        # Guards the peer table (add_pipe may run beside recv_frames) and the wake pipe
        # against close().
        self._lock = threading.Lock()
        self._endpoint = f"pipe://{os.getpid()}"
        self._rotate = 0
        self._pool = _BufferPool()
        self._shm = ShmPool() if shared_memory and SHM_AVAILABLE else None
        self._bad_releases = 0
        try:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
            for index, conn in items:
                self.add_pipe(conn, index)
        except BaseException:
            self.close()
            raise

    def add_pipe(self, pipe: Connection, index: int) -> PeerId:
        """Serve one more worker at ``index`` (a late joiner), or replace the pipe of a
        worker whose pipe broke (a restarted worker). Returns its peer id."""
        self._check_open()
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"worker indices must be non-negative ints; got {index!r}")
        with self._lock:
            old = self._peers.get(peer_id(index))
            if old is not None and old.lost is None:
                raise ValueError(f"worker {index} already has a working pipe")
            sock = _socket_of(pipe, f"pipe of worker {index}")
            writer = _Writer(pipe, sock, f"hub-{index}", self._shm)
            # Before anything else on this pipe: tell the worker who it is.
            writer.put(_Outgoing(None, record=_HEADER.pack(_ASSIGN, index)))
            peer = _Peer(index, pipe, sock, writer)
            self._peers[peer_id(index)] = peer
            self._by_conn[pipe] = peer
            if old is not None:
                del self._by_conn[old.conn]
        if old is not None:
            _close_end(old.conn, old.sock, old.writer)
        self.wake()  # a blocked recv_frames starts listening to the new pipe
        return peer_id(index)

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peers(self) -> list[PeerId]:
        """Every worker's peer id, lost or not."""
        with self._lock:
            return list(self._peers)

    def lost_peers(self) -> frozenset[PeerId]:
        """Workers whose pipe broke (they exited or were killed)."""
        with self._lock:
            return frozenset(pid for pid, peer in self._peers.items() if peer.lost is not None)

    def reserved_workers(self) -> frozenset[int]:
        """Each pipe's worker index: it belongs to whoever holds that pipe's other end."""
        with self._lock:
            return frozenset(peer.index for peer in self._peers.values())

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"pipe hub {self._endpoint} is closed")

    def _lose(self, peer: _Peer, why: str) -> None:
        if peer.lost is None:
            peer.lost = why
            self._lost += 1
            peer.writer.stop()
            if self._shm is not None:
                self._shm.forget(peer.writer)  # it reads no block any more
            log.warning("pipe of worker %d broke (%s): the worker is gone", peer.index, why)

    def send_frames(
        self, frames: Sequence[Buffer], *, to: Collection[PeerId] | None = None
    ) -> None:
        self._check_open()
        with self._lock:
            if to is None:
                targets: list[_Peer | None] = list(self._peers.values())
            else:
                targets = [self._peers.get(p) for p in to]
        if not targets:
            return
        shared, keep = self._share(frames)
        owned, buf = _owned(shared, self._pool)
        item = _Outgoing(
            owned,
            peek_kind(frames[0]) if frames else None,
            keep=keep,
            first=bool(frames) and starts_version(frames[0]),
        )
        if buf is not None:
            # Free again once every writer has written (or dropped) this message.
            self._pool.watch(buf, [item])
        self._unmap_retired()
        for peer in targets:
            if peer is None or peer.lost is not None:
                self._dropped += 1
                continue
            if peer.writer.broken is not None:
                self._lose(peer, peer.writer.broken)
            peer.writer.put(item)

    def _share(self, frames: Sequence[Buffer]) -> tuple[list[Buffer | _Ref], list[Any]]:
        if self._shm is None:
            return list(frames), []
        return self._shm.share(frames)

    def shared_buffer(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of shared memory that frames are later sent from without a copy
        (once they are read-only views of it), or None when there is none to lend."""
        self._check_open()
        if self._shm is None:
            return None
        lent = self._shm.lend(nbytes)
        return None if lent is None else lent[1]

    def _unmap_retired(self) -> None:
        if self._shm is None:
            return
        retired = self._shm.take_retired()
        if not retired:
            return
        with self._lock:
            peers = [p for p in self._peers.values() if p.lost is None]
        for block_id in retired:
            for peer in peers:
                peer.writer.put(_Outgoing(None, record=_HEADER.pack(_UNMAP, block_id)))

    def recv_frames(self, timeout: float | None) -> Incoming | None:
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                live = [p.conn for p in self._peers.values() if p.lost is None]
                by_conn = dict(self._by_conn)
            if live:  # take turns, so one chatty worker cannot starve the others
                self._rotate = (self._rotate + 1) % len(live)
                live = live[self._rotate :] + live[: self._rotate]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready = wait([*live, self._wake_r], remaining)
            except (OSError, ValueError) as exc:
                if any(conn.closed for conn in live):
                    continue  # add_pipe() replaced a broken pipe meanwhile: look again
                raise TransportError(f"waiting on worker pipes failed: {exc}") from exc
            woken = self._wake_r in ready
            if woken:
                self._drain_wake()
            for conn in ready:
                if conn is self._wake_r:
                    continue
                peer = by_conn[conn]  # type: ignore[index]
                try:
                    magic, count, frames, _ = _read_message(
                        peer.conn, peer.sock, self._max_message_bytes
                    )
                except (EOFError, OSError) as exc:
                    self._lose(peer, f"{type(exc).__name__}: {exc}" if str(exc) else "end of file")
                    continue
                if magic == _RELEASE:
                    if self._shm is None or not self._shm.release(count, peer.writer):
                        self._bad_releases += 1
                    else:
                        peer.writer.released()
                    continue
                if magic == _MESSAGE:
                    # A message beats a wake-up: whoever woke us wants the hub, and gets
                    # it back at once either way.
                    return Incoming(list(frames), peer_id(peer.index))
            if woken or (not ready and remaining is not None and remaining <= 0):
                return None

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 4096):
                pass

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            # Non-blocking: a full wake pipe already holds a wake-up.
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"\0")

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
        return counts

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
        for peer in peers:
            _close_end(peer.conn, peer.sock, peer.writer)
        if self._shm is not None:
            self._shm.close()
        for fd in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


class PipeSpoke(SpokeTransport):
    """A worker's end: the child end of its ``multiprocessing.Pipe()``.

    If the hub closes or its process dies, the spoke says so once in the log, drops what
    it is asked to send and receives nothing; it does not raise (the receiver's own
    timeouts report a missing sender).
    """

    lends_memory = True  # shared blocks, reused once released

    name = "pipe"

    def __init__(self, pipe: Connection) -> None:
        self._sock = _socket_of(pipe, "the worker's pipe")
        self._conn = pipe
        self._writer = _Writer(pipe, self._sock, "spoke")
        self._closed = False
        self._closed_event = threading.Event()
        self._hub_gone: str | None = None
        self._early: deque[list[Buffer]] = deque()  # read while waiting for our index
        self._pool = _BufferPool()  # receive buffers, reused once no frame views them
        self._blocks: dict[int, np.ndarray] = {}  # the hub's shared blocks, mapped read-only
        #: This worker's index, as the hub assigned it (``None`` until it has arrived).
        self.peer_index: int | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def endpoint(self) -> str:
        """A name for messages: the pipe has no address."""
        return "pipe://worker" if self.peer_index is None else f"pipe://worker-{self.peer_index}"

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed("this worker's pipe spoke is closed")

    def send_frames(self, frames: Sequence[Buffer]) -> None:
        self._check_open()
        if self._hub_gone is None and self._writer.broken is not None:
            self._gone(self._writer.broken)
        self._writer.put(_Outgoing(_owned(frames)[0], peek_kind(frames[0]) if frames else None))

    def _gone(self, why: str) -> None:
        if self._hub_gone is None:
            self._hub_gone = why
            log.warning("the sender's end of the pipe is gone (%s)", why)

    def _read(self, deadline: float | None, *, until_index: bool = False) -> list[Buffer] | None:
        """The next message, reading index assignments on the way; None on timeout (or,
        with ``until_index``, once an index has arrived)."""
        while True:
            if self._hub_gone is not None:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._closed_event.wait(remaining)  # nothing will ever come: just time out
                return None
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                if not self._conn.poll(remaining):
                    return None
                magic, index, frames, shared = _read_message(
                    self._conn, self._sock, None, self._pool, self._blocks
                )
            except (EOFError, OSError) as exc:
                self._gone(f"{type(exc).__name__}: {exc}" if str(exc) else "end of file")
                continue
            if magic == _ASSIGN:
                self.peer_index = index
                if until_index:
                    return None
                continue
            if magic == _UNMAP:
                self._blocks.pop(index, None)  # unmapped once no frame views it
                continue
            if magic == _BLOCK:
                continue
            for block_id, views in shared.items():
                self._release_when_gone(block_id, views)
            return frames

    def _release_when_gone(self, block_id: int, views: list[np.ndarray]) -> None:
        """Tell the hub once every one of ``views`` is garbage: it may reuse the block."""
        left = [len(views)]
        lock = threading.Lock()
        record = _HEADER.pack(_RELEASE, block_id)

        def one_gone() -> None:
            with lock:
                left[0] -= 1
                done = left[0] == 0
            if done and not self._closed:
                self._writer.put(_Outgoing(None, record=record))

        for view in views:
            weakref.finalize(view, one_gone)

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
        """Messages this spoke dropped (the hub gone, or not reading)."""
        return {"dropped_sends": self._writer.dropped}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closed_event.set()
        _close_end(self._conn, self._sock, self._writer)
        self._blocks.clear()
