"""The records hub and peers exchange about shared memory: one codec for every transport.

- :class:`Offer` (hub to peer): where the hub's probe block is (never its token).
- :class:`Join` (peer to hub): the token read there, which proves the peer can map the
  hub's blocks; :class:`Leave`: it cannot. :class:`Joined` (hub to peer): the slot and
  secret a peer on a shared channel signs its releases with.
- :class:`Lease` (hub to peer): one message whose large frames are places in blocks.
- :class:`Keeps` (peer to hub): this peer keeps the version it holds mapped until the
  next one is in (its weights are views of the block: ``apply_mode="shared"``), so a
  block still held is no reason to hold back the next version.
- :class:`TakesDevice` (peer to hub): this peer's model lives on the GPU of that UUID
  digest, on the hub's host: a version in a device block of that GPU may be lent to it
  as it is (:mod:`zmqsync.transport.cuda`).
- :class:`DeviceGrant` (hub to peer, where no pipe passes it on its own): device block
  ``block``'s CUDA IPC handle, for that peer alone (:mod:`zmqsync.transport.cuda`).
- :class:`LentAt` (peer to hub): the peer's tensors lie in its memfd (pid, descriptor,
  inode, size), laid out as a version of that layout digest: the hub may write each
  such version straight into it (:mod:`zmqsync.transport.shm.lent`); ``nbytes`` 0: it
  lends nothing (any more). :class:`Ask` (hub to peer): may the hub write version
  ``version`` into it now? :class:`Go` (peer to hub): yes, the peer holds its lock (or
  no: ``ok`` false, send it the stream). :class:`Written` (hub to peer): the version
  lies in the peer's tensors, with its metadata (or, ``ok`` false, the hub wrote
  nothing and sends the stream).
- :class:`Release` (peer to hub): one lease on each named block ends (ordered channels:
  pipes, Ray calls). :class:`Holding` (peer to hub): which blocks a peer still views,
  as of the messages it has seen (lossy channels: ZeroMQ, where a message a peer never
  got must not keep its lease).

Each record is one frame that starts with a magic no zmqsync protocol message starts
with. :func:`decode` checks every count against its bound and the record's length
before it builds anything, and raises :class:`RecordError` for anything malformed.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from zmqsync.protocol import Buffer

__all__ = [
    "ADDRESSED",
    "FAN_OUT",
    "MAX_DEVICE_HANDLE",
    "MAX_WRITTEN_METADATA",
    "NO_DEVICE",
    "TOKEN_BYTES",
    "Ask",
    "DeviceGrant",
    "Entry",
    "Go",
    "Holding",
    "Join",
    "Joined",
    "Keeps",
    "Lease",
    "Leave",
    "LentAt",
    "Offer",
    "Record",
    "RecordError",
    "Release",
    "TakesDevice",
    "Written",
    "decode",
    "encode",
    "is_lent_record",
    "is_record",
    "written_in",
]

#: The channels a lease travels on, where a transport has two (ZeroMQ's PUB and
#: ROUTER): each delivers in order, but not in order with the other, so what a peer has
#: seen is counted per channel.
FAN_OUT: Final = 0
ADDRESSED: Final = 1
#: Bytes of the token at the start of a hub's probe block.
TOKEN_BYTES: Final = 16
#: Bounds on a lease: its frames, the live blocks it names, its slot bitmap's bytes.
MAX_ENTRIES: Final = 1 << 16
MAX_LIVE: Final = 1 << 16
MAX_BITMAP: Final = 1 << 17

_OFFER: Final = b"ZLof"
_JOIN: Final = b"ZLjo"
_LEAVE: Final = b"ZLno"
_JOINED: Final = b"ZLok"
_LEASE: Final = b"ZLle"
_RELEASE: Final = b"ZLre"
_HOLDING: Final = b"ZLho"
_KEEPS: Final = b"ZLke"
_DEVICE: Final = b"ZLdv"
_DEVICE_BODY: Final = struct.Struct("<16s")
_HANDLE: Final = b"ZLdh"
_HANDLE_HEAD: Final = struct.Struct("<qq")  # block id, the hub's pid; the handle follows
#: Bytes of an encoded device handle a :class:`DeviceGrant` may carry.
MAX_DEVICE_HANDLE: Final = 2048
_MAGIC_BYTES: Final = 4
_LENDS: Final = b"ZLld"
_LENDS_BODY: Final = struct.Struct("<qqQQ16s")  # pid, fd, inode, nbytes, layout digest
_ASK: Final = b"ZLas"
_ASK_BODY: Final = struct.Struct("<qq16s")  # version, epoch, layout digest
_GO: Final = b"ZLgo"
_GO_BODY: Final = struct.Struct("<qqB")  # version, epoch, ok
_WRITTEN: Final = b"ZLwr"
#: version, epoch, flags (1: ok; 2: unusable, without ok); the metadata follows
_WRITTEN_HEAD: Final = struct.Struct("<qqB")
#: Bytes of a version's metadata (JSON) a :class:`Written` may carry.
MAX_WRITTEN_METADATA: Final = 64 * 1024

_OFFER_BODY: Final = struct.Struct("<qqQ")  # pid, fd, inode of the probe block
_JOIN_BODY: Final = struct.Struct(f"<{TOKEN_BYTES}s")
_JOINED_BODY: Final = struct.Struct("<IQ8s")  # slot, first counted seq, secret
#: pid, seq, channel, frames, live block ids, base slot, bitmap bytes
_LEASE_HEAD: Final = struct.Struct("<qQIIIII")
#: per frame: block id (-1: inline), fd, inode, block size, offset, length
_ENTRY: Final = struct.Struct("<qqQQQQ")
_ID: Final = struct.Struct("<q")
_COUNT: Final = struct.Struct("<I")
_HOLDING_HEAD: Final = struct.Struct("<I8sQQI")  # slot, secret, seen per channel, ids held


class RecordError(ValueError):
    """A shared-memory record that is malformed."""


@dataclass(frozen=True, slots=True)
class Offer:
    pid: int
    fd: int
    inode: int


@dataclass(frozen=True, slots=True)
class Join:
    token: bytes


@dataclass(frozen=True, slots=True)
class Leave:
    pass


@dataclass(frozen=True, slots=True)
class Joined:
    slot: int
    first_seq: int
    secret: bytes


@dataclass(frozen=True, slots=True)
class Entry:
    """Where one frame of a lease lies: a block (``block < 0``: inline, in the frames
    after the record) and the bytes ``offset .. offset + length`` of it."""

    block: int
    fd: int = -1
    inode: int = 0
    size: int = 0
    offset: int = 0
    length: int = 0


@dataclass(frozen=True, slots=True)
class Lease:
    """One message as places in the hub's blocks (owned by process ``pid``).

    ``live``: the blocks that exist now (a peer may unmap any other). ``seq``, and
    ``slots`` from ``base`` on: the message's number on its ``channel``, and the peers
    whose leases the hub counts for it (where the channel is shared).
    """

    pid: int
    entries: tuple[Entry, ...]
    live: tuple[int, ...] = ()
    seq: int = 0
    channel: int = FAN_OUT
    base: int = 0
    slots: bytes = b""

    def counts(self, slot: int) -> bool:
        """Whether the hub counts a lease for the peer in ``slot``."""
        i = slot - self.base
        return 0 <= i < 8 * len(self.slots) and bool(self.slots[i >> 3] & (1 << (i & 7)))

    @staticmethod
    def bitmap(slots: Sequence[int]) -> tuple[int, bytes]:
        """``(base, slots)`` naming these slots."""
        if not slots:
            return 0, b""
        base = min(slots)
        bits = bytearray((max(slots) - base) // 8 + 1)
        for s in slots:
            bits[(s - base) >> 3] |= 1 << ((s - base) & 7)
        return base, bytes(bits)

    @staticmethod
    def max_size(frames: int) -> int:
        """The largest encoded lease of ``frames`` frames (to bound a read)."""
        return (
            _MAGIC_BYTES
            + _LEASE_HEAD.size
            + frames * _ENTRY.size
            + MAX_LIVE * _ID.size
            + MAX_BITMAP
        )


@dataclass(frozen=True, slots=True)
class Release:
    blocks: tuple[int, ...]

    @staticmethod
    def max_size(blocks: int) -> int:
        """The largest encoded release naming ``blocks`` blocks (to bound a read)."""
        return _MAGIC_BYTES + _COUNT.size + blocks * _ID.size


@dataclass(frozen=True, slots=True)
class Keeps:
    """The peer keeps each version it holds mapped until the next one is in."""


@dataclass(frozen=True, slots=True)
class Holding:
    slot: int
    secret: bytes
    #: The newest seq seen, per channel.
    seen: tuple[int, int]
    held: frozenset[int]


@dataclass(frozen=True, slots=True)
class TakesDevice:
    """The peer's model lives on the GPU ``uuid`` names (a 16-byte digest);
    :data:`NO_DEVICE`: on none the hub may lend (it could not open a block)."""

    uuid: bytes


@dataclass(frozen=True, slots=True)
class DeviceGrant:
    """Device block ``block`` of the hub in process ``pid``: its encoded CUDA IPC
    handle (:class:`~zmqsync.transport.cuda.handles.DeviceHandle`), made for the one
    peer it is sent to."""

    block: int
    pid: int
    handle: bytes


@dataclass(frozen=True, slots=True)
class LentAt:
    """The peer's tensors lie in the memfd ``fd`` of process ``pid`` (``inode``, of
    ``nbytes``), each where a version of ``layout`` (its 16-byte digest) puts it;
    ``nbytes`` 0: the peer lends nothing."""

    pid: int
    fd: int
    inode: int
    nbytes: int
    layout: bytes


@dataclass(frozen=True, slots=True)
class Ask:
    """May the hub write ``version`` (of ``epoch``, laid out as ``layout``) into the
    peer's lent tensors now? Asked again after the peer said go: the hub is still
    writing it (the peer holds its lock on, and says nothing)."""

    version: int
    epoch: int
    layout: bytes


@dataclass(frozen=True, slots=True)
class Go:
    """The answer to an :class:`Ask`: ``ok``, the peer holds its lock until
    :class:`Written`; else the hub sends that version the usual way."""

    version: int
    epoch: int
    ok: bool


@dataclass(frozen=True, slots=True)
class Written:
    """``ok``: version ``version`` lies in the peer's lent tensors, with its
    ``metadata`` (JSON, at most :data:`MAX_WRITTEN_METADATA` bytes); else the hub wrote
    nothing of it, and ``unusable`` says whether because it could not use the memory the
    peer lends (it cannot open it: the peer may lend other memory)."""

    version: int
    epoch: int
    ok: bool
    metadata: bytes = b""
    unusable: bool = False


#: The GPU of a peer that takes no device blocks.
NO_DEVICE: Final = bytes(16)


Record = (
    Offer
    | Join
    | Leave
    | Joined
    | Lease
    | Release
    | Holding
    | Keeps
    | TakesDevice
    | DeviceGrant
    | LentAt
    | Ask
    | Go
    | Written
)

_MAGICS: Final = frozenset(
    {
        _OFFER,
        _JOIN,
        _LEAVE,
        _JOINED,
        _LEASE,
        _RELEASE,
        _HOLDING,
        _KEEPS,
        _DEVICE,
        _HANDLE,
        _LENDS,
        _ASK,
        _GO,
        _WRITTEN,
    }
)


_LENT_MAGICS: Final = frozenset({_LENDS, _ASK, _GO, _WRITTEN})


def is_record(frames: Sequence[Buffer]) -> bool:
    """Whether ``frames`` starts with one of these records (by its magic)."""
    return (
        len(frames) >= 1
        and len(frames[0]) >= _MAGIC_BYTES
        and bytes(frames[0][:_MAGIC_BYTES]) in _MAGICS
    )


def is_lent_record(frames: Sequence[Buffer]) -> bool:
    """Whether ``frames`` is one record of the lent tensors' handshake (:class:`LentAt`,
    :class:`Ask`, :class:`Go` or :class:`Written`), by its magic."""
    return (
        len(frames) == 1
        and len(frames[0]) >= _MAGIC_BYTES
        and bytes(frames[0][:_MAGIC_BYTES]) in _LENT_MAGICS
    )


def written_in(frame: Buffer) -> bool:
    """Whether ``frame`` is the hub's :class:`Written` saying a version is in a worker's
    lent tensors (after which the worker forgets the hub's blocks it maps)."""
    if len(frame) < _MAGIC_BYTES or bytes(frame[:_MAGIC_BYTES]) != _WRITTEN:
        return False
    try:
        record = decode(frame)
    except RecordError:
        return False  # the receiver counts it
    return isinstance(record, Written) and record.ok


def _ids(ids: Sequence[int] | frozenset[int]) -> bytes:
    return b"".join(_ID.pack(i) for i in ids)


def encode(record: Record) -> bytes:
    """``record`` as one frame."""
    if isinstance(record, Offer):
        return _OFFER + _OFFER_BODY.pack(record.pid, record.fd, record.inode)
    if isinstance(record, Join):
        return _JOIN + _JOIN_BODY.pack(record.token)
    if isinstance(record, Leave):
        return _LEAVE
    if isinstance(record, Keeps):
        return _KEEPS
    if isinstance(record, TakesDevice):
        return _DEVICE + _DEVICE_BODY.pack(record.uuid)
    if isinstance(record, DeviceGrant):
        return _HANDLE + _HANDLE_HEAD.pack(record.block, record.pid) + record.handle
    if isinstance(record, LentAt):
        body = _LENDS_BODY.pack(record.pid, record.fd, record.inode, record.nbytes, record.layout)
        return _LENDS + body
    if isinstance(record, Ask):
        return _ASK + _ASK_BODY.pack(record.version, record.epoch, record.layout)
    if isinstance(record, Go):
        return _GO + _GO_BODY.pack(record.version, record.epoch, record.ok)
    if isinstance(record, Written):
        flags = 1 if record.ok else 2 * record.unusable
        head = _WRITTEN_HEAD.pack(record.version, record.epoch, flags)
        return _WRITTEN + head + record.metadata
    if isinstance(record, Joined):
        return _JOINED + _JOINED_BODY.pack(record.slot, record.first_seq, record.secret)
    if isinstance(record, Lease):
        head = _LEASE_HEAD.pack(
            record.pid,
            record.seq,
            record.channel,
            len(record.entries),
            len(record.live),
            record.base,
            len(record.slots),
        )
        entries = b"".join(
            _ENTRY.pack(e.block, e.fd, e.inode, e.size, e.offset, e.length) for e in record.entries
        )
        return b"".join((_LEASE, head, entries, _ids(record.live), record.slots))
    if isinstance(record, Release):
        return _RELEASE + _COUNT.pack(len(record.blocks)) + _ids(record.blocks)
    head = _HOLDING_HEAD.pack(record.slot, record.secret, *record.seen, len(record.held))
    return _HOLDING + head + _ids(record.held)


def _fixed(body: bytes, layout: struct.Struct) -> tuple[int | bytes, ...]:
    if len(body) != layout.size:
        raise RecordError(f"a record body of {len(body)} bytes, expected {layout.size}")
    return layout.unpack(body)


def _id_list(body: bytes, offset: int, count: int) -> tuple[int, ...]:
    return tuple(_ID.unpack_from(body, offset + i * _ID.size)[0] for i in range(count))


def _lease(body: bytes) -> Lease:
    if len(body) < _LEASE_HEAD.size:
        raise RecordError("a lease shorter than its header")
    pid, seq, channel, count, live, base, nbits = _LEASE_HEAD.unpack_from(body)
    if count > MAX_ENTRIES or live > MAX_LIVE or nbits > MAX_BITMAP or channel > ADDRESSED:
        raise RecordError("a lease over the limits")
    end = _LEASE_HEAD.size + count * _ENTRY.size + live * _ID.size + nbits
    if len(body) != end:
        raise RecordError(f"a lease of {len(body)} bytes, expected {end}")
    offset = _LEASE_HEAD.size
    entries = tuple(
        Entry(*_ENTRY.unpack_from(body, offset + i * _ENTRY.size)) for i in range(count)
    )
    offset += count * _ENTRY.size
    return Lease(
        pid, entries, _id_list(body, offset, live), seq, channel, base, body[end - nbits : end]
    )


def _counted_ids(body: bytes, head: struct.Struct, count: int) -> tuple[int, ...]:
    if count > MAX_LIVE or len(body) != head.size + count * _ID.size:
        raise RecordError(f"a list of {count} block ids in a record of {len(body)} bytes")
    return _id_list(body, head.size, count)


def _flag(value: int | bytes) -> bool:
    if value not in (0, 1):
        raise RecordError(f"a flag of {value!r}")
    return value == 1


def decode(frame: Buffer) -> Record:
    """The record in ``frame``; :class:`RecordError` if it is none, or malformed."""
    raw = bytes(frame)
    magic, body = raw[:_MAGIC_BYTES], raw[_MAGIC_BYTES:]
    if magic == _OFFER:
        pid, fd, inode = _fixed(body, _OFFER_BODY)
        return Offer(int(pid), int(fd), int(inode))
    if magic == _JOIN:
        (token,) = _fixed(body, _JOIN_BODY)
        return Join(bytes(token))
    if magic == _KEEPS:
        if body:
            raise RecordError("a keeps record carries nothing")
        return Keeps()
    if magic == _DEVICE:
        (uuid,) = _fixed(body, _DEVICE_BODY)
        return TakesDevice(bytes(uuid))
    if magic == _HANDLE:
        if not _HANDLE_HEAD.size < len(body) <= _HANDLE_HEAD.size + MAX_DEVICE_HANDLE:
            raise RecordError(f"a device block record of {len(body)} bytes")
        block, pid = _HANDLE_HEAD.unpack_from(body)
        return DeviceGrant(int(block), int(pid), body[_HANDLE_HEAD.size :])
    if magic == _LENDS:
        pid, fd, inode, nbytes, layout = _fixed(body, _LENDS_BODY)
        if int(pid) <= 0 or int(fd) < 0:
            raise RecordError(f"lent memory at pid {pid!r}, fd {fd!r}")
        return LentAt(int(pid), int(fd), int(inode), int(nbytes), bytes(layout))
    if magic == _ASK:
        version, epoch, layout = _fixed(body, _ASK_BODY)
        return Ask(int(version), int(epoch), bytes(layout))
    if magic == _GO:
        version, epoch, ok = _fixed(body, _GO_BODY)
        return Go(int(version), int(epoch), _flag(ok))
    if magic == _WRITTEN:
        if not _WRITTEN_HEAD.size <= len(body) <= _WRITTEN_HEAD.size + MAX_WRITTEN_METADATA:
            raise RecordError(f"a written record of {len(body)} bytes")
        version, epoch, flags = _WRITTEN_HEAD.unpack_from(body)
        if flags not in (0, 1, 2):
            raise RecordError(f"written flags of {flags!r}")
        meta = body[_WRITTEN_HEAD.size :]
        return Written(int(version), int(epoch), flags == 1, meta, unusable=flags == 2)
    if magic == _LEAVE:
        if body:
            raise RecordError("a leave record carries nothing")
        return Leave()
    if magic == _JOINED:
        slot, first_seq, secret = _fixed(body, _JOINED_BODY)
        return Joined(int(slot), int(first_seq), bytes(secret))
    if magic == _LEASE:
        return _lease(body)
    if magic == _RELEASE:
        if len(body) < _COUNT.size:
            raise RecordError("a release shorter than its header")
        (count,) = _COUNT.unpack_from(body)
        return Release(_counted_ids(body, _COUNT, count))
    if magic == _HOLDING:
        if len(body) < _HOLDING_HEAD.size:
            raise RecordError("a holding record shorter than its header")
        slot, secret, seen_fan, seen_addressed, count = _HOLDING_HEAD.unpack_from(body)
        held = frozenset(_counted_ids(body, _HOLDING_HEAD, count))
        return Holding(slot, secret, (seen_fan, seen_addressed), held)
    raise RecordError(f"not a shared-memory record: {magic!r}")
