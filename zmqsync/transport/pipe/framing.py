"""What travels on one pipe, and reading it.

Each unit on the pipe starts with one record written with ``Connection.send_bytes``:

- a header (:data:`HEADER`: magic and a count): a message (``MESSAGE``: every frame's
  length follows in a second record, then the frames' bytes, raw), a worker's index
  (``ASSIGN``), a block's descriptor (``BLOCK``: one byte follows, the descriptor
  attached to it with ``SCM_RIGHTS``), or a device block's CUDA IPC handle (``DEVICE``:
  one record follows, :class:`~zmqsync.transport.cuda.handles.DeviceHandle`);
- or a shared-memory record (:mod:`~zmqsync.transport.shm.records`): a lease from the
  hub (its inline frames' bytes follow, raw), or a release from a worker.

``Connection.send``/``recv`` are never used: they pickle, and no pickle travels on
zmqsync's data path. Nor is ``Connection.recv_bytes``: it waits without a bound in the
middle of a record (a peer that writes half of one and stops would hold the reading
thread forever), through Python layers (an ``io.BytesIO`` per read). Records are read
off the socket in ``Connection``'s format; a message's raw bytes into one buffer with
``recv_into``. A worker (:func:`read`, one peer) waits for the rest of a unit at most
:data:`STALL_SECONDS`; the hub (:class:`~zmqsync.transport.pipe.units.UnitReader`, every
worker on one thread) never waits for it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Final

import numpy as np

from zmqsync.protocol import MAX_BUFFERS, Buffer
from zmqsync.transport.cuda import handles
from zmqsync.transport.cuda.handles import DEVICE_IDS
from zmqsync.transport.pipe.buffers import POOL_MIN_BYTES, BufferPool
from zmqsync.transport.shm.borrowing import PeerBlocks, borrow
from zmqsync.transport.shm.records import (
    Ask,
    Go,
    Lease,
    LentAt,
    RecordError,
    Release,
    Written,
    decode,
    encode,
    is_record,
)

log = logging.getLogger("zmqsync.transport.pipe")

__all__ = [
    "ASSIGN",
    "HEADER",
    "MAX_FRAMES",
    "Received",
    "header_of",
    "message_head",
    "read",
    "record_of",
    "shutdown",
    "sizes_of",
    "socket_of",
    "split_frames",
    "write_block",
    "write_device_block",
    "write_lease",
    "write_message",
]

#: A header record: magic, then a count (of frames, or the index or block it names).
HEADER: Final = struct.Struct("<4sI")
_LENGTH: Final = struct.Struct("<Q")
#: How ``Connection.send_bytes`` prefixes a record: its length, or -1 and a 64-bit one.
_RECORD_SIZE: Final = struct.Struct("!i")
_RECORD_SIZE64: Final = struct.Struct("!Q")
MESSAGE: Final = b"ZSP2"
#: The record that tells a worker its index (the count field carries the index).
ASSIGN: Final = b"ZSPI"
#: Hub to worker: block ``count`` follows, its file descriptor attached to one byte.
BLOCK: Final = b"ZSPB"
#: Hub to worker: device block ``count``'s CUDA IPC handle follows, in one record.
DEVICE: Final = b"ZSPD"
#: Frames per message: the protocol's buffer limit plus the header and schema frames.
MAX_FRAMES: Final = MAX_BUFFERS + 2
#: The frames of one message follow its first record at once. A peer silent for this
#: long in the middle of a message is stuck (stopped, or confused) and its pipe is given
#: up: the stream cannot be resynchronised, and nothing may wait on it forever.
STALL_SECONDS: Final = 10.0
#: Received frames at least this large are handed out as views of a pooled buffer.
_VIEW_MIN_BYTES: Final = 64 * 1024


def socket_of(conn: Connection, what: str) -> socket.socket:
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


def shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


# --- writing ------------------------------------------------------------------------------


def message_head(frames: Sequence[Buffer]) -> tuple[bytes, bytes]:
    """A message's first two records: its header, and its frames' lengths."""
    return (
        HEADER.pack(MESSAGE, len(frames)),
        b"".join(_LENGTH.pack(memoryview(f).nbytes) for f in frames),
    )


def write_message(conn: Connection, frames: Sequence[Buffer]) -> None:
    """A message's first records (the frames' raw bytes are the caller's to write)."""
    for record in message_head(frames):
        conn.send_bytes(record)


def write_lease(conn: Connection, lease: Lease) -> None:
    """A lease's record (its inline frames' raw bytes are the caller's to write)."""
    conn.send_bytes(encode(lease))


def write_block(conn: Connection, sock: socket.socket, block_id: int, fd: int) -> None:
    """Pass block ``block_id``'s descriptor to the peer."""
    conn.send_bytes(HEADER.pack(BLOCK, block_id))
    socket.send_fds(sock, [b"B"], [fd])


def write_device_block(conn: Connection, block_id: int, handle: bytes) -> None:
    """Pass device block ``block_id``'s encoded CUDA IPC handle to the peer."""
    conn.send_bytes(HEADER.pack(DEVICE, block_id))
    conn.send_bytes(handle)


# --- reading ------------------------------------------------------------------------------


@dataclass
class Received:
    """What one read brought: a message's frames, a worker's index, or a release."""

    frames: list[Buffer] | None = None
    #: Per lent block the message's frames lie in, the frames that view it.
    views: dict[int, list[np.ndarray]] = field(default_factory=dict)
    index: int | None = None
    release: Release | None = None
    #: The worker keeps each version mapped until the next (a :class:`Keeps` record).
    keeps: bool = False
    #: The GPU the worker's model lives on (a :class:`TakesDevice` record).
    device: bytes | None = None
    #: A device block this worker could not open (its handle was malformed, or of a GPU
    #: this process does not see).
    refused: int | None = None
    #: The blocks a lease named that this worker could not read (it never opened them):
    #: the message is dropped, and its lease on each is to be released.
    unread: tuple[int, ...] = ()
    #: A record of the lent tensors' handshake (a worker's LentAt or Go on the hub; the
    #: hub's Ask or Written on a worker).
    lent: LentAt | Go | Ask | Written | None = None


def _stall(conn: Connection, what: str) -> None:
    if not conn.poll(STALL_SECONDS):
        raise OSError(f"the peer stopped {what} for {STALL_SECONDS:g}s")


def _stall_unless_there(conn: Connection, sock: socket.socket, what: str) -> None:
    """:func:`_stall` only if nothing is there to read yet: a message is mostly written
    in one go, and a peek costs less than ``Connection.poll``'s selector."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        _stall(conn, what)
    # A broken pipe raises OSError here; end of file, in the read that follows.


def _recv_exact(conn: Connection, sock: socket.socket, nbytes: int, *, first: bool) -> bytes:
    """``nbytes`` bytes of a record, read with as few calls as the pipe allows (mostly
    one). ``first``: they start a unit, so an end of file here is a clean one."""
    data = b""
    while True:
        try:
            got = sock.recv(nbytes - len(data), socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            _stall(conn, "in the middle of a record")
            continue
        if not got:
            if first and not data:
                raise EOFError
            raise EOFError("the pipe closed in the middle of a record")
        data = data + got if data else got
        if len(data) == nbytes:
            return data


def _recv_record(
    conn: Connection, sock: socket.socket, max_bytes: int, *, first: bool = False
) -> bytes:
    """One record as ``Connection.send_bytes`` writes it (a big-endian 32-bit length,
    or -1 and a 64-bit one, then the bytes), read from the socket itself: the same bytes
    as ``Connection.recv_bytes``, without its Python layers (a ``BytesIO`` per read),
    and bounded by ``STALL_SECONDS`` in the middle of one. Never reads past the record
    (a block's descriptor may ride on the next byte)."""
    (size,) = _RECORD_SIZE.unpack(_recv_exact(conn, sock, _RECORD_SIZE.size, first=first))
    if size == -1:
        (size,) = _RECORD_SIZE64.unpack(_recv_exact(conn, sock, _RECORD_SIZE64.size, first=False))
    if size < 0 or size > max_bytes:
        raise OSError("bad message length")
    return _recv_exact(conn, sock, size, first=False) if size else b""


def _recv_raw(
    conn: Connection, sock: socket.socket, nbytes: int, pool: BufferPool | None = None
) -> Any:
    """``nbytes`` raw bytes, read straight into one buffer (from ``pool``, if given)."""
    buf: Any = pool.lend(nbytes)[:nbytes] if pool is not None else bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        try:  # the rest is mostly there already: wait only when it is not
            n = sock.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            _stall(conn, "in the middle of a message")
            continue
        if n == 0:
            raise EOFError("the pipe closed in the middle of a message")
        got += n
    return buf


def _recv_block(conn: Connection, sock: socket.socket, block_id: int) -> np.ndarray:
    """Map the block whose descriptor rides on the next byte, read-only."""
    _stall(conn, f"before sending block {block_id}")
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
    return np.frombuffer(mapped, dtype=np.uint8) if mapped is not None else np.empty(0, np.uint8)


def _recv_device_block(conn: Connection, sock: socket.socket, block_id: int) -> Any:
    """Open the device block whose handle is the next record (None: it cannot be
    opened here; logged)."""
    _stall(conn, f"before sending device block {block_id}")
    return handles.open_block(block_id, _recv_record(conn, sock, handles.DeviceHandle.max_size()))


def split_frames(raw: Any, sizes: list[int], pool: BufferPool | None) -> list[Buffer]:
    """Split one received buffer into its frames (of ``sizes``)."""
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


def _recv_frames(
    conn: Connection,
    sock: socket.socket,
    sizes: list[int],
    max_message_bytes: int | None,
    pool: BufferPool | None,
) -> list[Buffer]:
    total = sum(sizes)
    if max_message_bytes is not None and total > max_message_bytes:
        raise OSError(f"a message of {total} bytes exceeds the limit of {max_message_bytes}")
    return split_frames(_recv_raw(conn, sock, total, pool), sizes, pool)


def header_of(first: bytes) -> tuple[bytes, int]:
    """A header record's magic and count (OSError: it is not one)."""
    if len(first) != HEADER.size:
        raise OSError(f"a pipe header is {HEADER.size} bytes; got {len(first)}")
    magic, count = HEADER.unpack(first)
    return magic, count


def record_of(first: bytes) -> Any:
    """The shared-memory record ``first`` is (OSError: a malformed one)."""
    try:
        return decode(first)
    except RecordError as exc:
        raise OSError(f"a malformed shared-memory record on the pipe: {exc}") from exc


def read(
    conn: Connection,
    sock: socket.socket,
    max_message_bytes: int | None,
    pool: BufferPool | None,
    blocks: PeerBlocks,
) -> Received:
    """A worker's next unit from the hub, whose first record must be readable now.

    Frames are views of one buffer that the caller owns, or of shared-memory ``blocks``
    (filled by ``BLOCK`` records). Raises EOFError or OSError when the pipe broke or
    carries bytes that are not ours (the stream is then lost: it cannot be
    resynchronised). The hub reads its workers with a
    :class:`~zmqsync.transport.pipe.units.UnitReader`, which never waits.
    """
    first = _recv_record(conn, sock, Lease.max_size(MAX_FRAMES), first=True)
    if is_record([first]):
        record = record_of(first)
        if isinstance(record, Ask | Written):
            if isinstance(record, Written) and record.ok:
                # A version in the lent tensors: the blocks mapped for the versions
                # before are forgotten, so that one the hub retires frees its memory;
                # the hub hands a block over again when it names it next.
                blocks.forget_host()
            return Received(lent=record)
        if not isinstance(record, Lease):
            raise OSError(f"a {type(record).__name__} record where none belongs")
        if len(record.entries) > MAX_FRAMES:
            raise OSError(f"a message of {len(record.entries)} frames exceeds {MAX_FRAMES}")
        sizes = [e.length for e in record.entries if e.block < 0]
        inline = _recv_frames(conn, sock, sizes, max_message_bytes, pool)
        try:
            frames, views = borrow(record, iter(inline), blocks)
        except (RecordError, ValueError) as exc:
            named = {e.block for e in record.entries if e.block >= 0}
            if any(b >= DEVICE_IDS and b not in blocks for b in named):
                # A device block it refused: the stream is whole, only this message lost.
                return Received(unread=tuple(sorted(named)))
            raise OSError(f"a lease this worker cannot read: {exc}") from exc
        return Received(frames, views)
    magic, count = header_of(first)
    if magic == ASSIGN:
        return Received(index=count)
    if magic == BLOCK:
        blocks.add(count, _recv_block(conn, sock, count))
        return Received()
    if magic == DEVICE:
        opened = _recv_device_block(conn, sock, count)
        if opened is None:
            return Received(refused=count)
        blocks.add(count, opened)
        return Received()
    if magic != MESSAGE:
        raise OSError(f"bad pipe record magic {magic!r}: is someone else writing on this pipe?")
    if count > MAX_FRAMES:
        raise OSError(f"a message of {count} frames exceeds the limit of {MAX_FRAMES}")
    _stall_unless_there(conn, sock, "in the middle of a message")
    table = _recv_record(conn, sock, count * _LENGTH.size)
    return Received(_recv_frames(conn, sock, sizes_of(table, count), max_message_bytes, pool))


def sizes_of(table: bytes, count: int) -> list[int]:
    """The frame lengths a message's table record gives (OSError: not ``count`` of them)."""
    if len(table) != count * _LENGTH.size:
        raise OSError(f"the frame table of {count} frames takes {count * _LENGTH.size} bytes")
    return [n for (n,) in _LENGTH.iter_unpack(table)]
