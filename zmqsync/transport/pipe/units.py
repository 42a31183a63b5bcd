"""The hub's reader of one worker's pipe: units taken as their bytes come, never waited on.

The hub serves every worker from one thread. :func:`~zmqsync.transport.pipe.framing.read`
(a worker's, which has one peer) waits for the rest of a unit it has begun; on the hub
that wait would hold every other worker's acks behind one that wrote part of a unit and
stopped (SIGSTOPped, or hostile), and a send with a timeout shorter than the wait would
fail for them. A :class:`UnitReader` keeps what came of a unit and returns; the hub goes
on with the others and gives the pipe up once nothing more has come for
:data:`~zmqsync.transport.pipe.framing.STALL_SECONDS` (:attr:`UnitReader.since`).

What a worker writes: records (``Connection.send_bytes``' format: a big-endian 32-bit
length, or -1 and a 64-bit one, then the bytes) and messages (a ``MESSAGE`` header
record, a record of the frames' lengths, then the frames' bytes, raw).
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Final

from zmqsync.transport.pipe.framing import (
    ASSIGN,
    MAX_FRAMES,
    MESSAGE,
    Received,
    header_of,
    record_of,
    sizes_of,
    split_frames,
)
from zmqsync.transport.shm.records import Go, Keeps, LentAt, Release, TakesDevice, is_record

__all__ = ["UnitReader"]

_LENGTH_BYTES: Final = 8  # one frame's length in a message's table
_SIZE: Final = struct.Struct("!i")
_SIZE64: Final = struct.Struct("!Q")
#: The largest first record a worker writes: a release naming a message's worth of blocks.
_MAX_FIRST: Final = Release.max_size(MAX_FRAMES)

# What the reader waits for: a record's length (32-bit, or the 64-bit one after -1), a
# record's bytes (the unit's first, or a message's table), or a message's raw frames.
_FIRST, _FIRST64, _FIRST_BODY, _TABLE, _TABLE64, _TABLE_BODY, _RAW = range(7)


class UnitReader:
    """One worker's units, read on the hub as far as the pipe has them.

    Args:
        sock: the hub's end of the worker's pipe (a handle on its socket).
        max_message_bytes: the largest message accepted; a larger one is refused (OSError)
            before anything is allocated for it.
    """

    __slots__ = (
        "_count",
        "_field",
        "_got",
        "_max",
        "_moved",
        "_part",
        "_raw",
        "_size",
        "_sizes",
        "_sock",
        "since",
    )

    def __init__(self, sock: socket.socket, max_message_bytes: int | None) -> None:
        self._sock = sock
        self._max = max_message_bytes
        self._field = _FIRST
        self._part = b""  # what came of the length or record under way
        self._size = 0  # that record's length
        self._count = 0  # the message's frames
        self._sizes: list[int] = []
        self._raw: bytearray | None = None  # the message's frames, being filled
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
            need = (
                _SIZE.size
                if field in (_FIRST, _TABLE)
                else _SIZE64.size
                if field in (_FIRST64, _TABLE64)
                else self._size
            )
            data = self._take(need)
            if data is None:
                self._wait()
                return None
            if field in (_FIRST, _TABLE):
                (size,) = _SIZE.unpack(data)
                if size == -1:
                    self._field = field + 1  # its 64-bit length follows
                    continue
                self._length(size, field + 2)
            elif field in (_FIRST64, _TABLE64):
                (size,) = _SIZE64.unpack(data)
                self._length(size, field + 1)
            elif field == _FIRST_BODY:
                unit = self._first(data)
                if unit is not None:
                    return self._done(unit)
            else:  # the table
                self._sizes = sizes = sizes_of(data, self._count)
                total = sum(sizes)
                if self._max is not None and total > self._max:
                    raise OSError(f"a message of {total} bytes exceeds the limit of {self._max}")
                self._raw, self._got, self._field = bytearray(total), 0, _RAW

    def _length(self, size: int, body: int) -> None:
        bound = _MAX_FIRST if body == _FIRST_BODY else self._count * _LENGTH_BYTES
        if size < 0 or size > bound:
            raise OSError("bad message length")
        self._size, self._field = size, body

    def _first(self, first: bytes) -> Received | None:
        """The unit a first record makes (None: a message, whose table follows)."""
        if is_record([first]):
            record = record_of(first)
            if isinstance(record, Release):
                return Received(release=record)
            if isinstance(record, Keeps):
                return Received(keeps=True)
            if isinstance(record, TakesDevice):
                return Received(device=record.uuid)
            if isinstance(record, LentAt | Go):
                return Received(lent=record)
            raise OSError(f"a {type(record).__name__} record where none belongs")
        magic, count = header_of(first)
        if magic == ASSIGN:
            return Received(index=count)
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
        """The message, once its raw frames all came (else None)."""
        raw = self._raw
        assert raw is not None
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
        self._raw = None
        return self._done(Received(split_frames(raw, self._sizes, None)))

    def _wait(self) -> None:
        """Nothing more now: a unit begun waits for the rest, stamped when it last moved."""
        if self._field == _FIRST and not self._part:
            self.since = None  # between units
        elif self._moved or self.since is None:
            self.since = time.monotonic()

    def _done(self, unit: Received) -> Received:
        self._field, self.since = _FIRST, None
        return unit
