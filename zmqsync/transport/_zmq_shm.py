"""Shared memory for ZeroMQ peers on the hub's host: large frames read in place.

Over ``ipc://`` every worker is on the learner's host, so a version need not cross a
socket at all. The hub writes each large frame once into a block from
:class:`~zmqsync.transport._shm.ShmPool` (a sender's snapshot already lies in one, and
is sent as it is); the message that travels only says where each frame lies, and each
worker copies straight from the block into its model.

Nothing here trusts that a peer can read the blocks, or that it keeps up:

1. **Offer.** The first time a spoke speaks, the hub sends it (over the ROUTER) its pid
   and the descriptor and inode of a small probe block, which holds a random token. The
   offer does not carry the token: knowing it proves a peer opened the block.
2. **Join.** A spoke that can open ``/proc/<pid>/fd/<fd>`` (same host, same pid
   namespace, allowed to) reads the token there and answers with it. Others decline
   and keep getting every byte inline.
3. **Registered.** The hub gives the spoke a *slot*, a secret, and the first sequence
   number of the shared messages whose holds are counted for it.
4. **Shared messages** name, for each frame, its block (id, descriptor, inode), offset
   and length, the blocks still alive, and a bitmap of the slots the hub counts holds
   for. A spoke reads a shared message only if its slot is in it: a spoke whose
   registration has not landed, or was dropped, never maps a block that the hub might
   rewrite under it. It skips the message (counted) and the sender's repair path (or an
   inline copy the hub sent beside it) brings the version.
5. **Releases** go back over the ack channel, as the first frame of the ack they
   precede (or alone when no ack is due): the highest shared sequence seen, and the
   blocks still viewed. The hub rewrites a block only once
   every peer it counted has seen a later message and views it no more.

A peer that keeps a block longer than :data:`LEASE` seconds after it was lent (dead,
stopped, stuck) is dropped from the bitmap and the blocks it held are retired, never
rewritten: its mapping stays valid, the pages are freed when it unmaps them or exits,
and the hub makes new blocks. Blocks are opened by descriptor number but checked by
inode, so a number the hub reused for another block is never mistaken for the old one.

Only hub and spoke of this module speak these records; each starts with a magic that no
zmqsync message starts with. A malformed or forged one (wrong secret) is counted and
dropped.
"""

from __future__ import annotations

import logging
import os
import secrets
import struct
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from zmqsync.protocol import Buffer
from zmqsync.transport._shm import (
    SHM_AVAILABLE,
    Block,
    PeerBlocks,
    Ref,
    ShmPool,
    map_peer_block,
)

__all__ = ["SHM_AVAILABLE", "ShmLender", "ShmReader", "is_record"]

log = logging.getLogger("zmqsync.transport")

_OFFER: Final = b"ZSHO"
_OFFER_BODY: Final = struct.Struct("<qqQ")  # pid, fd, inode of the probe block
_JOIN: Final = b"ZSHJ"
_JOIN_BODY: Final = struct.Struct("<16s")  # the token read from the probe block
#: Bytes of the token at the start of the probe block.
_TOKEN_BYTES: Final = _JOIN_BODY.size
_LEAVE: Final = b"ZSHL"
_REGISTERED: Final = b"ZSHS"
_REGISTERED_BODY: Final = struct.Struct("<IQ8s")  # slot, first counted seq, secret
_SHARED: Final = b"ZSHM"
#: magic, pid, seq, channel, frames, live block ids, base slot, bitmap bytes
_SHARED_HEAD: Final = struct.Struct("<4sqQIIIII")
#: per frame: block id (-1: inline), fd, inode, block size, offset, length
_ENTRY: Final = struct.Struct("<qqQQQQ")
_ID: Final = struct.Struct("<q")
_RELEASE: Final = b"ZSHR"
_RELEASE_HEAD: Final = struct.Struct("<4sI8sQQI")  # magic, slot, secret, seen per channel, ids held
#: The sockets shared messages travel on. Each delivers in order, but not in order with
#: the other, so what a peer has seen is counted per channel.
FAN_OUT: Final = 0
ADDRESSED: Final = 1
#: Records this module exchanges; no zmqsync protocol message starts like these.
_MAGICS: Final = frozenset({_OFFER, _JOIN, _LEAVE, _REGISTERED, _SHARED, _RELEASE})

#: Seconds a peer may keep a block, from when it was lent, before the peer is dropped
#: from the bitmap and its blocks retired. A worker releases within milliseconds of
#: reading; this is for the dead and the stopped.
LEASE: Final = 10.0
#: Blocks a spoke keeps mapped; the hub's live list trims it sooner.
MAX_MAPS: Final = 8
#: Bound on a shared message's frame count and on its bitmap (slots in one message).
MAX_ENTRIES: Final = 1 << 16
MAX_BITMAP: Final = 1 << 17
#: Shared messages whose sender's frames the hub keeps until every peer counted for them
#: released them (a sender streams no further than its window meanwhile). Past this,
#: the oldest are let go of (held by a stopped peer: the sender's stall covers it).
MAX_KEPT: Final = 256


def is_record(frames: Sequence[Buffer]) -> bool:
    """Whether ``frames`` is one of this module's records (by its magic)."""
    return len(frames) >= 1 and len(frames[0]) >= 4 and bytes(frames[0][:4]) in _MAGICS


def _has_slot(bitmap: bytes, base: int, slot: int) -> bool:
    i = slot - base
    return 0 <= i < 8 * len(bitmap) and bool(bitmap[i >> 3] & (1 << (i & 7)))


def _bitmap(slots: Sequence[int]) -> tuple[int, bytes]:
    if not slots:
        return 0, b""
    base = min(slots)
    bits = bytearray((max(slots) - base) // 8 + 1)
    for s in slots:
        bits[(s - base) >> 3] |= 1 << ((s - base) & 7)
    return base, bytes(bits)


# --- the hub's side ---------------------------------------------------------------------


@dataclass
class _Member:
    """A registered spoke: its slot, and what the hub counts it as holding."""

    peer: bytes
    slot: int
    secret: bytes
    first_seq: int
    seen: list[int] = field(default_factory=lambda: [0, 0])  # per channel
    #: Block id -> channel -> seq of the last shared message naming it that this peer
    #: was counted for.
    sent: dict[int, dict[int, int]] = field(default_factory=dict)
    #: Block id -> when it was lent to this peer (the first message naming it since the
    #: peer last released it): each block's lease runs from then. Per block, so that
    #: releasing newer blocks never renews the lease of an old one still held.
    lent_at: dict[int, float] = field(default_factory=dict)


class ShmLender:
    """The hub's side: offers shared memory, registers spokes, builds shared messages,
    counts holds from releases. Not thread-safe: the hub calls it under its own use."""

    def __init__(self, pool: ShmPool | None = None) -> None:
        self.pool = pool or ShmPool()
        self._token = secrets.token_bytes(_TOKEN_BYTES)
        probe = Block(0, 4096)
        probe.array[:_TOKEN_BYTES] = np.frombuffer(self._token, dtype=np.uint8)
        self._probe = probe
        # Where the token lies, never the token: a peer proves it can open our blocks by
        # reading it there.
        self._offer = _OFFER + _OFFER_BODY.pack(os.getpid(), probe.fd, probe.inode)
        self._members: dict[bytes, _Member] = {}
        self._by_slot: dict[int, _Member] = {}
        self._slots = iter(range(1, 1 << 31))
        self._seq = 0
        self._offered: set[bytes] = set()
        #: seq -> (the caller's frames, channel, block ids, peers yet to release it):
        #: the frames stay referenced, so a sender watching them knows when workers are
        #: done with that message (not merely when its record went out).
        self._kept: dict[int, tuple[Any, int, set[int], set[bytes]]] = {}
        self.counters: Counter[str] = Counter()

    # offers and registrations

    def offer(self, peer: bytes) -> list[bytes] | None:
        """The offer to send ``peer`` on first contact, or None (offered already)."""
        if peer in self._offered or peer in self._members:
            return None
        self._offered.add(peer)
        return [self._offer]

    def members(self) -> set[bytes]:
        return set(self._members)

    def on_request(self, peer: bytes, frames: Sequence[Buffer]) -> list[bytes] | None:
        """A join or leave from ``peer`` (over the ROUTER); returns the reply, if any."""
        head = bytes(frames[0])
        if head[:4] == _JOIN and len(frames) == 1 and len(head) == 4 + _JOIN_BODY.size:
            if not secrets.compare_digest(head[4:], self._token):
                self.counters["bad_records"] += 1
                return None
            self.drop(peer, "re-joined")  # a spoke that joins again starts afresh
            member = _Member(peer, next(self._slots), secrets.token_bytes(8), self._seq + 1)
            member.seen = [self._seq, self._seq]
            self._members[peer] = member
            self._by_slot[member.slot] = member
            self.counters["joined"] += 1
            body = _REGISTERED_BODY.pack(member.slot, member.first_seq, member.secret)
            return [_REGISTERED + body]
        if head[:4] == _LEAVE and len(frames) == 1:
            self.counters["declined"] += 1
            self.drop(peer, "left")
            self._offered.add(peer)  # it cannot read our blocks: do not offer again
            return None
        self.counters["bad_records"] += 1
        return None

    def drop(self, peer: bytes, why: str) -> None:
        """Stop counting ``peer``; retire every block it may still read (never rewrite
        one under it). It is offered again on its next contact."""
        member = self._members.pop(peer, None)
        self._offered.discard(peer)
        if member is None:
            return
        del self._by_slot[member.slot]
        self._let_go(peer)
        self.pool.abandon(peer, member.sent)
        if member.sent:
            log.info("shared memory: dropped a peer holding %d block(s): %s", len(member.sent), why)

    # releases

    def on_release(self, frames: Sequence[Buffer]) -> None:
        """A release record from the ack channel: which shared messages a peer has seen
        and which blocks it still views."""
        try:
            if len(frames) != 1:
                raise struct.error("one frame expected")
            raw = bytes(frames[0])
            _, slot, secret, seen_fan, seen_addr, n = _RELEASE_HEAD.unpack_from(raw)
            if len(raw) != _RELEASE_HEAD.size + n * _ID.size:
                raise struct.error("wrong length")
            held = {i for (i,) in _ID.iter_unpack(raw[_RELEASE_HEAD.size :])}
        except struct.error:
            self.counters["bad_records"] += 1
            return
        member = self._by_slot.get(slot)
        if (
            member is None
            or not secrets.compare_digest(secret, member.secret)
            or max(seen_fan, seen_addr) > self._seq
        ):
            self.counters["bad_records"] += 1
            return
        seen = member.seen
        seen[FAN_OUT] = max(seen[FAN_OUT], seen_fan)
        seen[ADDRESSED] = max(seen[ADDRESSED], seen_addr)
        self._let_go(member.peer, seen, held)
        for block_id, by_channel in list(member.sent.items()):
            if block_id not in held and all(q <= seen[ch] for ch, q in by_channel.items()):
                self.pool.drop_hold(block_id, member.peer)
                del member.sent[block_id]
                del member.lent_at[block_id]
        self.counters["releases"] += 1

    def _let_go(
        self, peer: bytes, seen: list[int] | None = None, held: set[int] | None = None
    ) -> None:
        """``peer`` released the kept messages it has seen and no longer views (all of
        them if ``seen`` is None: it is gone); keep the frames others still read."""
        for seq in list(self._kept):
            _, channel, blocks, pending = self._kept[seq]
            if peer in pending and (
                seen is None or (seq <= seen[channel] and not blocks & (held or set()))
            ):
                pending.discard(peer)
                if not pending:
                    del self._kept[seq]

    # sending

    def share(
        self, frames: Sequence[Buffer], peers: Sequence[bytes], channel: int
    ) -> list[bytes | Any] | None:
        """``frames`` as one shared message, to go out on ``channel``, whose holds are
        counted for ``peers`` (the registered ones among them). None: nobody registered,
        a large frame not in a block (memory from :meth:`shared_buffer`), or a block
        retired meanwhile; then send ``frames`` as they are."""
        members = [self._members[p] for p in peers if p in self._members]
        if not members:
            return None
        # Only memory lent by shared_buffer() goes as it is: copying the caller's frames
        # into a block would be the serialised copy zero-copy sends avoid.
        found = self.pool.share(frames, copy=False)
        if found is None:
            return None
        shared, keep = found
        refs = [f for f in shared if isinstance(f, Ref)]
        if not refs:
            return None  # nothing large
        self.pool.take_retired()  # spokes learn it from the live list instead
        self._seq += 1
        now = time.monotonic()
        blocks = {f.block.id: f.block for f in refs}
        for member in members:
            for block in blocks.values():
                if self.pool.hold(block, member.peer):
                    member.sent.setdefault(block.id, {})[channel] = self._seq
                    member.lent_at.setdefault(block.id, now)  # a block held on keeps its lease
        del keep  # the holds keep the blocks now
        self._kept[self._seq] = (list(frames), channel, set(blocks), {m.peer for m in members})
        while len(self._kept) > MAX_KEPT:
            del self._kept[next(iter(self._kept))]
        entries, inline = [], []
        for f in shared:
            if isinstance(f, Ref):
                b = f.block
                entries.append(_ENTRY.pack(b.id, b.fd, b.inode, b.size, f.offset, f.length))
            else:
                entries.append(_ENTRY.pack(-1, -1, 0, 0, 0, 0))
                inline.append(f)
        live = self.pool.live_ids()
        base, bits = _bitmap([m.slot for m in members])
        head = b"".join(
            (
                _SHARED_HEAD.pack(
                    _SHARED,
                    os.getpid(),
                    self._seq,
                    channel,
                    len(shared),
                    len(live),
                    base,
                    len(bits),
                ),
                *entries,
                *(_ID.pack(i) for i in live),
                bits,
            )
        )
        self.counters["shared_sends"] += 1
        return [head, *inline]

    def expire(self) -> None:
        """Drop the peers that held a block past :data:`LEASE` since it was lent to
        them (call before choosing whom a message counts)."""
        now = time.monotonic()
        for member in list(self._members.values()):
            oldest = min(member.lent_at.values(), default=None)
            if oldest is not None and now - oldest > LEASE:
                self.counters["expired"] += 1
                self.drop(member.peer, f"held a block for over {LEASE:g}s")

    def shared_buffer(self, nbytes: int) -> Any:
        if not self._members:
            return None
        lent = self.pool.lend(nbytes)
        return None if lent is None else lent[1]

    def stats(self) -> dict[str, int]:
        out = {f"shm_{k}": v for k, v in self.counters.items()}
        out["shm_bytes"] = self.pool.nbytes()
        out["shm_peers"] = len(self._members)
        return out

    def close(self) -> None:
        self._kept.clear()
        self.pool.close()
        self._probe.close()
        self._members.clear()
        self._by_slot.clear()


# --- the spoke's side -------------------------------------------------------------------


class ShmReader:
    """The spoke's side: answers offers, reads shared messages in place, reports what it
    still views. ``request(frames)`` sends to the hub's ROUTER. Called from the spoke's
    thread only; the views it hands out may die on any thread."""

    def __init__(self, request: Callable[[list[bytes]], None]) -> None:
        self._request = request
        #: The hub's pid, its probe block's inode, and the token read there, once joined.
        self._offer: tuple[int, int, bytes] | None = None
        self._slot: int | None = None
        self._joining = False  # a join is on its way; its answer is not
        self._secret = b""
        self._first_seq = 0
        self._seen = [0, 0]  # per channel
        self._early: list[Buffer] | None = None  # a shared message that beat our slot
        self._maps = PeerBlocks(MAX_MAPS)
        self._lock = threading.Lock()
        self._held: Counter[int] = Counter()  # block id -> live views
        self._dirty = False
        self.counters: Counter[str] = Counter()

    @property
    def active(self) -> bool:
        """True once the hub counts this spoke: received frames may lie in its blocks."""
        return self._slot is not None

    def on_record(self, frames: Sequence[Buffer]) -> list[Buffer] | None:
        """Handle a record from the hub; returns a shared message's frames, else None."""
        head = bytes(frames[0][:4])
        try:
            if head == _OFFER:
                self._on_offer(bytes(frames[0]))
            elif head == _REGISTERED and self._offer is not None:
                body = bytes(frames[0][4:])
                self._slot, self._first_seq, self._secret = _REGISTERED_BODY.unpack(body)
                self._joining = False
                self._seen = [max(s, self._first_seq - 1) for s in self._seen]
                early, self._early = self._early, None
                if early is not None:
                    return self._resolve(early)
            elif head == _SHARED:
                return self._resolve(frames)
            else:
                self.counters["bad_records"] += 1
        except (struct.error, ValueError, OSError, StopIteration) as exc:
            self._dirty = True  # report what was seen: the hub counts us for nothing held
            self.counters["failures"] += 1
            log.warning("could not read a shared-memory record from the hub: %s", exc)
        return None

    def _on_offer(self, record: bytes) -> None:
        pid, fd, inode = _OFFER_BODY.unpack(record[4:])
        if self._offer is not None and self._offer[:2] == (pid, inode) and self._joining:
            return  # it offered before it heard our join
        # A hub offers to peers it does not count: a new one, or ours, which dropped us.
        self._offer = None
        self._slot = None
        try:
            token = bytes(map_peer_block(pid, fd, _TOKEN_BYTES, inode)[:_TOKEN_BYTES])
        except (OSError, ValueError):
            self.counters["not_readable"] += 1
            self._request([_LEAVE])
            return
        self._offer = (pid, inode, token)
        self._join()

    def _join(self) -> None:
        assert self._offer is not None
        self._slot = None
        self._joining = True
        self._request([_JOIN + self._offer[2]])

    def _resolve(self, frames: Sequence[Buffer]) -> list[Buffer] | None:
        head = bytes(frames[0])
        _, pid, seq, channel, count, live, base, nbits = _SHARED_HEAD.unpack_from(head)
        if count > MAX_ENTRIES or live > MAX_ENTRIES or nbits > MAX_BITMAP or channel > 1:
            raise ValueError("a shared message over the limits")
        offset = _SHARED_HEAD.size
        end = offset + count * _ENTRY.size + live * _ID.size + nbits
        if len(head) != end:
            raise ValueError(f"a shared message header of {len(head)} bytes, expected {end}")
        if self._offer is None or pid != self._offer[0]:
            self.counters["skipped"] += 1  # not from the hub we joined
            return None
        slot = self._slot
        if slot is None:
            self._early = list(frames)  # joined, slot on its way: read it once it is here
            return None
        entries = [_ENTRY.unpack_from(head, offset + i * _ENTRY.size) for i in range(count)]
        offset += count * _ENTRY.size
        alive = {_ID.unpack_from(head, offset + i * _ID.size)[0] for i in range(live)}
        if seq < self._first_seq or not _has_slot(head[offset + live * _ID.size :], base, slot):
            self.counters["skipped"] += 1
            if seq >= self._first_seq and not self._joining:
                self._join()  # not counted any more (the hub dropped us): for the next ones
            return None
        self._seen[channel] = max(self._seen[channel], seq)  # reported once views die
        self._maps.keep_only(pid, alive)  # the others were retired by the hub
        inline = iter(frames[1:])
        out: list[Any] = []  # buffers: bytes from the socket, numpy views of blocks
        views: dict[int, list[np.ndarray]] = {}
        for block_id, fd, inode, size, start, length in entries:
            if block_id < 0:
                out.append(next(inline))
                continue
            view = self._maps.view(pid, block_id, fd, size, start, length, inode)
            views.setdefault(block_id, []).append(view)
            out.append(view)
        if next(inline, None) is not None:
            raise ValueError("a shared message carries more inline frames than it names")
        with self._lock:
            for block_id, held in views.items():
                self._held[block_id] += len(held)
                for view in held:
                    weakref.finalize(view, self._view_gone, block_id)
        self.counters["shared_frames"] += sum(len(v) for v in views.values())
        return out

    def _view_gone(self, block_id: int) -> None:
        with self._lock:
            self._held[block_id] -= 1
            if self._held[block_id] <= 0:
                del self._held[block_id]
                self._dirty = True

    def pending_report(self) -> list[bytes] | None:
        """The release record to send on the ack channel now (before any other message
        there), or None."""
        if not self._dirty or self._slot is None:
            return None
        with self._lock:
            self._dirty = False
            held = list(self._held)
        return [
            _RELEASE_HEAD.pack(_RELEASE, self._slot, self._secret, *self._seen, len(held))
            + b"".join(_ID.pack(i) for i in held)
        ]

    def stats(self) -> dict[str, int]:
        return {f"shm_{k}": v for k, v in self.counters.items()}

    def close(self) -> None:
        self._maps.clear()
        self._slot = None
        self._early = None
