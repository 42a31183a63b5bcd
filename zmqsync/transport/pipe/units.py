"""Reading one pipe: units taken as their bytes come, never waited on.

A unit is one record (``Connection.send_bytes``' format: a big-endian 32-bit length, or
-1 and a 64-bit one, then the bytes) and what its kind says follows it: a message's
record of its frames' lengths and the frames' raw bytes, a lease's inline frames, a
block's descriptor (on one byte, with ``SCM_RIGHTS``), a device block's handle.

Neither end waits in the middle of a unit. The hub reads every worker on one thread: a
worker that wrote part of a unit and stopped (SIGSTOPped, or hostile) must not hold the
others' acks, and the hub gives its pipe up once nothing more has come for
:data:`~zmqsync.transport.pipe.framing.STALL_SECONDS` (:attr:`UnitReader.since`). A
worker reads its one hub within its own deadlines: a learner stopped in the middle of a
unit and continued later costs the worker nothing but the wait.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import time
from typing import Any, Final

import numpy as np

from zmqsync.transport.cuda import handles
from zmqsync.transport.cuda.handles import DEVICE_IDS
from zmqsync.transport.pipe.buffers import BufferPool
from zmqsync.transport.pipe.framing import (
    ASSIGN,
    BLOCK,
    DEVICE,
    MAX_FRAMES,
    MESSAGE,
    Received,
    header_of,
    record_of,
    sizes_of,
    split_frames,
    table_bytes,
)
from zmqsync.transport.shm.borrowing import PeerBlocks, borrow
from zmqsync.transport.shm.records import (
    Ask,
    Go,
    Keeps,
    Lease,
    LentAt,
    RecordError,
    Release,
    TakesDevice,
    Written,
    is_record,
)

__all__ = ["UnitReader"]

_SIZE: Final = struct.Struct("!i")
_SIZE64: Final = struct.Struct("!Q")

# What the reader waits for. Three records have a length (32-bit, or the 64-bit one
# after -1) and bytes: the unit's first, a message's table, a device block's handle.
# Then a message's or a lease's raw frames, or a block's descriptor.
_FIRST, _FIRST64, _FIRST_BODY = 0, 1, 2
_TABLE, _TABLE64, _TABLE_BODY = 3, 4, 5
_HANDLE, _HANDLE64, _HANDLE_BODY = 6, 7, 8
_RAW, _FD = 9, 10
_LENGTHS: Final = (_FIRST, _TABLE, _HANDLE)
_LENGTHS64: Final = (_FIRST64, _TABLE64, _HANDLE64)


class UnitReader:
    """One pipe's units, read as far as the pipe has them.

    Args:
        sock: this end of the pipe (a handle on its socket).
        max_message_bytes: the largest message accepted; a larger one is refused (OSError)
            before anything is allocated for it.
        blocks: a worker's shared-memory blocks (``BLOCK`` units add to them; frames of a
            lease are views of them); None on the hub, which reads a worker's records.
        pool: where a worker's received frames are placed (None: a buffer each).
    """

    __slots__ = (
        "_blocks",
        "_count",
        "_field",
        "_got",
        "_lease",
        "_max",
        "_max_first",
        "_moved",
        "_part",
        "_pool",
        "_raw",
        "_size",
        "_sizes",
        "_sock",
        "since",
    )

    def __init__(
        self,
        sock: socket.socket,
        max_message_bytes: int | None,
        *,
        blocks: PeerBlocks | None = None,
        pool: BufferPool | None = None,
    ) -> None:
        self._sock = sock
        self._max = max_message_bytes
        self._blocks = blocks
        self._pool = pool
        #: The largest first record: a worker's lease of a message's worth of frames, or
        #: the hub's release naming as many blocks.
        self._max_first = (
            Lease.max_size(MAX_FRAMES) if blocks is not None else Release.max_size(MAX_FRAMES)
        )
        self._field = _FIRST
        self._part = b""  # what came of the length or record under way
        self._size = 0  # that record's length
        self._count = 0  # the message's frames, or the block a BLOCK or DEVICE names
        self._sizes: list[int] = []
        self._lease: Lease | None = None  # whose inline frames are being read
        self._raw: Any = None  # the frames, being filled
        self._got = 0
        self._moved = False  # bytes came in this call
        #: When the unit under way last got bytes (monotonic); None between units.
        self.since: float | None = None

    def read(self) -> Received | None:
        """The next unit, if the pipe now has the rest of it; else None (what came is
        kept, and :attr:`since` says since when). Never waits. Raises EOFError or OSError
        when the pipe broke or carries bytes that are not ours (it is then lost: the
        stream cannot be resynchronised)."""
        self._moved = False
        while True:
            field = self._field
            if field == _RAW:
                got = self._fill()
                if got is None:
                    self._wait()
                return got
            if field == _FD:
                got = self._block()
                if got is None:
                    self._wait()
                return got
            need = (
                _SIZE.size
                if field in _LENGTHS
                else _SIZE64.size
                if field in _LENGTHS64
                else self._size
            )
            data = self._take(need)
            if data is None:
                self._wait()
                return None
            if field in _LENGTHS:
                (size,) = _SIZE.unpack(data)
                if size == -1:
                    self._field = field + 1  # its 64-bit length follows
                    continue
                self._length(size, field + 2)
            elif field in _LENGTHS64:
                (size,) = _SIZE64.unpack(data)
                self._length(size, field + 1)
            elif field == _FIRST_BODY:
                unit = self._first(data)
                if unit is not None:
                    return self._done(unit)
            elif field == _TABLE_BODY:
                self._frames(sizes_of(data, self._count), None)
            else:  # a device block's handle
                return self._done(self._device(data))

    def _length(self, size: int, body: int) -> None:
        if body == _FIRST_BODY:
            bound = self._max_first
        elif body == _TABLE_BODY:
            bound = table_bytes(self._count)
        else:
            bound = handles.DeviceHandle.max_size()
        if size < 0 or size > bound:
            raise OSError("bad message length")
        self._size, self._field = size, body

    def _frames(self, sizes: list[int], lease: Lease | None) -> None:
        """Read ``sizes`` frames' raw bytes next (a message's, or a lease's inline ones)."""
        total = sum(sizes)
        if self._max is not None and total > self._max:
            raise OSError(f"a message of {total} bytes exceeds the limit of {self._max}")
        pool = self._pool
        self._raw = pool.lend(total)[:total] if pool is not None else bytearray(total)
        self._sizes, self._lease, self._got, self._field = sizes, lease, 0, _RAW

    def _first(self, first: bytes) -> Received | None:
        """The unit a first record makes (None: more of it follows)."""
        blocks = self._blocks
        if is_record([first]):
            record = record_of(first)
            if blocks is None:  # the hub: what a worker says
                if isinstance(record, Release):
                    return Received(release=record)
                if isinstance(record, Keeps):
                    return Received(keeps=True)
                if isinstance(record, TakesDevice):
                    return Received(device=record.uuid)
                if isinstance(record, LentAt | Go):
                    return Received(lent=record)
            elif isinstance(record, Ask | Written):
                if isinstance(record, Written) and record.ok:
                    # A version in the lent tensors: the blocks mapped for the versions
                    # before are forgotten, so that one the hub retires frees its memory;
                    # the hub hands a block over again when it names it next.
                    blocks.forget_host()
                return Received(lent=record)
            elif isinstance(record, Lease):
                if len(record.entries) > MAX_FRAMES:
                    raise OSError(f"a message of {len(record.entries)} frames exceeds {MAX_FRAMES}")
                self._frames([e.length for e in record.entries if e.block < 0], record)
                return None
            raise OSError(f"a {type(record).__name__} record where none belongs")
        magic, count = header_of(first)
        if magic == ASSIGN:
            return Received(index=count)
        if magic == BLOCK and blocks is not None:
            self._count, self._field = count, _FD
            return None
        if magic == DEVICE and blocks is not None:
            self._count, self._field = count, _HANDLE
            return None
        if magic != MESSAGE:
            raise OSError(f"bad pipe record magic {magic!r}: is someone else writing on this pipe?")
        if count > MAX_FRAMES:
            raise OSError(f"a message of {count} frames exceeds the limit of {MAX_FRAMES}")
        self._count, self._field = count, _TABLE
        return None

    def _take(self, nbytes: int) -> bytes | None:
        """The ``nbytes`` of the field under way, once all of them came (else None)."""
        part = self._part
        while len(part) < nbytes:
            try:
                got = self._sock.recv(nbytes - len(part), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                self._part = part
                return None
            if not got:
                if self._field == _FIRST and not part:
                    raise EOFError  # between units: a clean end
                raise EOFError("the pipe closed in the middle of a record")
            part = part + got if part else got
            self._moved = True
        self._part = b""
        return part

    def _fill(self) -> Received | None:
        """The message (or lease), once its raw frames all came (else None)."""
        raw = self._raw
        view, total = memoryview(raw), len(raw)
        while self._got < total:
            try:
                n = self._sock.recv_into(view[self._got :], 0, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return None
            if n == 0:
                raise EOFError("the pipe closed in the middle of a message")
            self._got += n
            self._moved = True
        lease, self._raw, self._lease = self._lease, None, None
        frames = split_frames(raw, self._sizes, self._pool)
        if lease is None:
            return self._done(Received(frames))
        return self._done(self._borrow(lease, frames))

    def _borrow(self, lease: Lease, inline: list[Any]) -> Received:
        """A lease's frames: views of the blocks it names, its inline frames between."""
        blocks = self._blocks
        assert blocks is not None
        try:
            frames, views = borrow(lease, iter(inline), blocks)
        except (RecordError, ValueError) as exc:
            named = {e.block for e in lease.entries if e.block >= 0}
            if any(b >= DEVICE_IDS and b not in blocks for b in named):
                # A device block it refused: the stream is whole, only this message lost.
                return Received(unread=tuple(sorted(named)))
            raise OSError(f"a lease this worker cannot read: {exc}") from exc
        return Received(frames, views)

    def _block(self) -> Received | None:
        """Map the block whose descriptor rides on the next byte, read-only."""
        block_id, blocks = self._count, self._blocks
        assert blocks is not None
        try:
            data, fds, _, _ = socket.recv_fds(self._sock, 1, 1, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        if not data:
            for fd in fds:
                os.close(fd)
            raise EOFError(f"the pipe closed before block {block_id}")
        if not fds:
            raise OSError(f"block {block_id} came without its file descriptor")
        fd = fds[0]
        for extra in fds[1:]:
            os.close(extra)
        try:
            size = os.fstat(fd).st_size
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
        blocks.add(
            block_id,
            np.empty(0, np.uint8) if mapped is None else np.frombuffer(mapped, np.uint8),
        )
        return self._done(Received())

    def _device(self, raw: bytes) -> Received:
        """Open the device block whose handle came (refused: it cannot be opened here;
        logged)."""
        blocks = self._blocks
        assert blocks is not None
        opened = handles.open_block(self._count, raw)
        if opened is None:
            return Received(refused=self._count)
        blocks.add(self._count, opened)
        return Received()

    def _wait(self) -> None:
        """Nothing more now: a unit begun waits for the rest, stamped when it last moved."""
        if self._field == _FIRST and not self._part:
            self.since = None  # between units
        elif self._moved or self.since is None:
            self.since = time.monotonic()

    def _done(self, unit: Received) -> Received:
        self._field, self.since = _FIRST, None
        return unit
