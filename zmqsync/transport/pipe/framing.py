"""What travels on one pipe: writing it, and the parts of reading it both ends share.

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
thread forever), through Python layers (an ``io.BytesIO`` per read). Both ends read
with a :class:`~zmqsync.transport.pipe.units.UnitReader`: records off the socket in
``Connection``'s format, a message's raw bytes into one buffer with ``recv_into``, and
never a wait in the middle of a unit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Final

import numpy as np

from zmqsync.protocol import MAX_BUFFERS, Buffer
from zmqsync.transport.pipe.buffers import POOL_MIN_BYTES, BufferPool
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
)

log = logging.getLogger("zmqsync.transport.pipe")

__all__ = [
    "ASSIGN",
    "HEADER",
    "MAX_FRAMES",
    "Received",
    "header_of",
    "message_head",
    "record_of",
    "shutdown",
    "sizes_of",
    "socket_of",
    "split_frames",
    "table_bytes",
    "write_block",
    "write_device_block",
    "write_lease",
    "write_message",
]

#: A header record: magic, then a count (of frames, or the index or block it names).
HEADER: Final = struct.Struct("<4sI")
_LENGTH: Final = struct.Struct("<Q")
MESSAGE: Final = b"ZSP2"
#: The record that tells a worker its index (the count field carries the index).
ASSIGN: Final = b"ZSPI"
#: Hub to worker: block ``count`` follows, its file descriptor attached to one byte.
BLOCK: Final = b"ZSPB"
#: Hub to worker: device block ``count``'s CUDA IPC handle follows, in one record.
DEVICE: Final = b"ZSPD"
#: Frames per message: the protocol's buffer limit plus the header and schema frames.
MAX_FRAMES: Final = MAX_BUFFERS + 2
#: The frames of one message follow its first record at once. A worker silent for this
#: long in the middle of a unit is stuck (stopped, or confused) and the hub gives its
#: pipe up: the stream cannot be resynchronised. (A worker waits for its hub's rest
#: within its own deadlines, without giving up: the hub is the one peer it has.)
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


def table_bytes(count: int) -> int:
    """The length of a message's table record for ``count`` frames."""
    return count * _LENGTH.size


def sizes_of(table: bytes, count: int) -> list[int]:
    """The frame lengths a message's table record gives (OSError: not ``count`` of them)."""
    if len(table) != table_bytes(count):
        raise OSError(f"the frame table of {count} frames takes {table_bytes(count)} bytes")
    return [n for (n,) in _LENGTH.iter_unpack(table)]
