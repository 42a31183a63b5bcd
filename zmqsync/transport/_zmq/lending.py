"""The hub's side of shared memory over ZeroMQ: large frames lent to peers on its host.

Over ``ipc://`` every worker is on the learner's host, so a version need not cross a
socket at all: the hub sends a lease naming where each large frame lies in its blocks
(a sender's snapshot already lies in one), and each worker copies from there. A learner
on a GPU lends device blocks the same way to the workers whose model lives on that GPU
(:mod:`zmqsync.transport.cuda`).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from zmqsync.protocol import Buffer
from zmqsync.transport.cuda import handles
from zmqsync.transport.cuda.blocks import DevicePool
from zmqsync.transport.cuda.handles import DEVICE_IDS
from zmqsync.transport.shm.blocks import BlockPool, Ref
from zmqsync.transport.shm.lending import ProbeBlock, lease_of
from zmqsync.transport.shm.records import (
    ADDRESSED,
    FAN_OUT,
    NO_DEVICE,
    DeviceGrant,
    Holding,
    Join,
    Joined,
    Keeps,
    Leave,
    RecordError,
    TakesDevice,
    decode,
    encode,
)

__all__ = ["Lender"]

log = logging.getLogger("zmqsync.transport")

#: Seconds a peer may keep a block, from when it was lent, before the peer is dropped
#: and its blocks retired. A worker releases within milliseconds of reading; this is
#: for the dead and the stopped.
LEASE_SECONDS: Final = 10.0
#: Leased messages whose sender's frames the hub keeps until every peer counted for
#: them released them (a sender streams no further than its window meanwhile). Past
#: this, the oldest are let go of (held by a stopped peer: the sender's stall covers it).
MAX_KEPT: Final = 256
#: Peers dropped for holding a block past their lease that the hub remembers as sent
#: copies (until they join again, leave, or are dropped for another reason); the
#: oldest are forgotten beyond it.
MAX_EXPIRED: Final = 1024
#: The largest slot number; a hub gives each join a new one.
_MAX_SLOT: Final = 1 << 31
#: Device blocks whose handle one peer is given at most before the oldest it was given
#: are forgotten (at most 3 are alive; retired ones are never named again).
MAX_GRANTED: Final = 16


@dataclass(frozen=True)
class Leased:
    """One message as a lease (its frames), and the device blocks it names."""

    frames: list[Any]
    devices: list[Any]


@dataclass
class _Member:
    """A joined spoke: its slot, and the leases the hub counts for it."""

    peer: bytes
    slot: int
    secret: bytes
    first_seq: int
    seen: list[int] = field(default_factory=lambda: [0, 0])  # per channel
    #: Block id -> channel -> seq of the last lease naming it counted for this peer.
    leased: dict[int, dict[int, int]] = field(default_factory=dict)
    #: Block id -> when it was lent to this peer (the first lease naming it since the
    #: peer last released it): each block's lease runs from then. Per block, so that
    #: releasing newer blocks never renews the lease of an old one still held.
    lent_at: dict[int, float] = field(default_factory=dict)
    #: The peer keeps each version mapped until the next (a :class:`Keeps` record): its
    #: blocks' leases run from when a later lease was counted for it, not from when lent.
    keeps: bool = False
    #: Block id -> when a later lease than the one naming it was counted for the peer.
    superseded_at: dict[int, float] = field(default_factory=dict)
    #: The GPU the peer's model lives on, as it said (a UUID digest), or None.
    device: bytes | None = None
    #: Device blocks whose handle the peer was given (oldest first).
    granted: list[int] = field(default_factory=list)


class Lender:
    """Lends the hub's blocks to the spokes that prove they can read them.

    Nothing here trusts that a peer can read the blocks, or that it keeps up:

    1. **Offer.** Once the sender admitted a spoke (its Welcome), the hub offers it (over
       the ROUTER) its probe block: pid, descriptor and inode, never the token written there.
    2. **Join.** A spoke that can open ``/proc/<pid>/fd/<fd>`` (same host, same pid
       namespace, allowed to) answers with the token. Others leave, and keep getting
       every byte inline.
    3. **Joined.** The hub gives the spoke a *slot*, a secret, and the first sequence
       number of the leases it counts for it.
    4. **Leases** name each frame's place, the blocks still alive, and the slots the
       hub counts a lease for. A spoke reads a lease only if its slot is in it: a spoke
       whose join has not landed, or was dropped, never maps a block the hub might
       rewrite under it. It skips the message (counted); the sender's repair path (or
       an inline copy sent beside it) brings the version.
    5. **Holdings** come back over the ack channel, in front of the ack they precede (or
       alone): the newest lease seen per channel, and the blocks still viewed. The hub
       rewrites a block only once every peer it counted has seen a later message and
       views it no more.

    A peer that keeps a block longer than :data:`LEASE_SECONDS` after it was lent (dead,
    stopped, stuck; for a peer that keeps each version mapped until the next, a
    :class:`Keeps` record, after a later lease was counted for it) is dropped and the
    blocks it held are retired, never rewritten: its mapping stays valid, the pages are
    freed when it unmaps them or exits, and the hub makes new blocks. A malformed or
    forged record (wrong secret) is counted and dropped.

    Not thread-safe: the hub calls it under its own use.
    """

    def __init__(self, *, device_memory: bool = True) -> None:
        self.pool = BlockPool()
        #: Device blocks, for peers that said their model lives on the learner's GPU.
        self.devices = DevicePool() if device_memory else None
        self._probe = ProbeBlock()
        self._members: dict[bytes, _Member] = {}
        self._by_slot: dict[int, _Member] = {}
        self._slots = iter(range(1, _MAX_SLOT))
        self._seq = 0
        self._offered: set[bytes] = set()
        #: seq -> (the caller's frames, channel, block ids, peers yet to release it):
        #: the frames stay referenced, so a sender watching them knows when workers are
        #: done with that message (not merely when its lease went out).
        self._kept: dict[int, tuple[Any, int, set[int], set[bytes]]] = {}
        self.counters: Counter[str] = Counter()
        #: Peers dropped for holding a block past their lease, not joined again: every
        #: message goes to them inline (copied), and each may still map the blocks it
        #: held (retired, never rewritten): peer -> how many.
        self._expired: dict[bytes, int] = {}

    # offers and joins

    def offer(self, peer: bytes) -> list[bytes] | None:
        """The offer to send an admitted ``peer``, or None (offered already)."""
        if peer in self._offered or peer in self._members:
            return None
        self._offered.add(peer)
        return [encode(self._probe.offer)]

    def members(self) -> set[bytes]:
        return set(self._members)

    def is_member(self, peer: bytes) -> bool:
        """Whether ``peer`` joined: it proved it can open this host's ``/proc/<pid>/fd``."""
        return peer in self._members

    def keeping(self) -> set[bytes]:
        """The members that keep each version mapped until the next."""
        return {peer for peer, member in list(self._members.items()) if member.keeps}

    def on_request(self, peer: bytes, frames: Sequence[Buffer]) -> list[bytes] | None:
        """A join or leave from ``peer`` (over the ROUTER); returns the reply, if any."""
        try:
            record = decode(frames[0]) if len(frames) == 1 else None
        except RecordError:
            record = None
        if isinstance(record, Join) and self._probe.proves(record):
            self.drop(peer, "re-joined")  # a spoke that joins again starts afresh
            member = _Member(peer, next(self._slots), secrets.token_bytes(8), self._seq + 1)
            member.seen = [self._seq, self._seq]
            self._members[peer] = member
            self._by_slot[member.slot] = member
            self.counters["joined"] += 1
            return [encode(Joined(member.slot, member.first_seq, member.secret))]
        if isinstance(record, Keeps) and peer in self._members:
            self._members[peer].keeps = True
            self.counters["keeping"] += 1
            return None
        if isinstance(record, TakesDevice) and peer in self._members:
            # Said again, it is given every handle anew (it lacked one a lease named).
            member = self._members[peer]
            member.device = None if record.uuid == NO_DEVICE else record.uuid
            member.granted.clear()
            return None
        if isinstance(record, Leave):
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
        self._expired.pop(peer, None)
        if member is None:
            return
        del self._by_slot[member.slot]
        self._release_kept(peer)
        self.pool.retire(i for i in member.leased if i < DEVICE_IDS)
        if self.devices is not None:
            self.devices.retire(i for i in member.leased if i >= DEVICE_IDS)
        if member.leased:
            log.info(
                "shared memory: dropped a peer holding %d block(s): %s", len(member.leased), why
            )

    # releases

    def on_release(self, frames: Sequence[Buffer]) -> None:
        """A holding from the ack channel: which leases a peer has seen and which blocks
        it still views."""
        try:
            record = decode(frames[0]) if len(frames) == 1 else None
        except RecordError:
            record = None
        member = self._by_slot.get(record.slot) if isinstance(record, Holding) else None
        if (
            not isinstance(record, Holding)
            or member is None
            or not secrets.compare_digest(record.secret, member.secret)
            or max(record.seen) > self._seq
        ):
            self.counters["bad_records"] += 1
            return
        seen = member.seen
        seen[FAN_OUT] = max(seen[FAN_OUT], record.seen[FAN_OUT])
        seen[ADDRESSED] = max(seen[ADDRESSED], record.seen[ADDRESSED])
        # A peer that keeps its version mapped is done with a message once it has seen
        # it: it holds its blocks (leased, never rewritten) until the next version is
        # in, and the sender's frames kept meanwhile would hold back its window.
        self._release_kept(member.peer, seen, frozenset() if member.keeps else record.held)
        for block_id, by_channel in list(member.leased.items()):
            if block_id not in record.held and all(q <= seen[c] for c, q in by_channel.items()):
                self._pool_of(block_id).release_all(block_id, member.peer)
                del member.leased[block_id]
                del member.lent_at[block_id]
                member.superseded_at.pop(block_id, None)
        self.counters["releases"] += 1

    def _release_kept(
        self, peer: bytes, seen: list[int] | None = None, held: frozenset[int] = frozenset()
    ) -> None:
        """``peer`` released the kept messages it has seen and no longer views (all of
        them if ``seen`` is None: it is gone); keep the frames others still read."""
        for seq in list(self._kept):
            _, channel, blocks, pending = self._kept[seq]
            if peer in pending and (seen is None or (seq <= seen[channel] and not blocks & held)):
                pending.discard(peer)
                if not pending:
                    del self._kept[seq]

    # sending

    def lease(
        self, frames: Sequence[Buffer], peers: Sequence[bytes], channel: int
    ) -> Leased | None:
        """``frames`` as one lease, to go out on ``channel``, counted for ``peers`` (the
        joined ones among them). None: nobody joined, a large frame not in a block
        (memory from :meth:`lend`), or a block retired meanwhile; then send ``frames``
        as they are."""
        members = [self._members[p] for p in peers if p in self._members]
        if not members:
            return None
        given = list(frames)  # what the sender watches (kept below)
        keep_device: list[Any] = []
        if self.devices is not None and any(handles.IPC.is_device(f) for f in frames):
            frames, keep_device = self.devices.place_device(frames)
        # Only memory lent by lend() goes as it is: copying the caller's frames into a
        # block would be the serialised copy zero-copy sends avoid.
        found = self.pool.place(frames, copy=False)
        if found is None:
            return None
        placed, keep = found
        blocks = {f.block.id: f.block for f in placed if isinstance(f, Ref)}
        if not blocks:
            return None  # nothing large
        self._seq += 1
        now = time.monotonic()
        for keeper in self._members.values():
            # A newer message exists (counted for it or not): what a peer that keeps
            # its version holds from now on counts towards its lease.
            if keeper.keeps:
                for block_id in keeper.leased.keys() - blocks.keys():
                    keeper.superseded_at.setdefault(block_id, now)
        for member in members:
            for block in blocks.values():
                if self._pool_of(block.id).lease(block, member.peer):
                    member.leased.setdefault(block.id, {})[channel] = self._seq
                    member.lent_at.setdefault(block.id, now)  # a block held on keeps its lease
        del keep, keep_device  # the leases keep the blocks now
        self._kept[self._seq] = (given, channel, set(blocks), {m.peer for m in members})
        while len(self._kept) > MAX_KEPT:
            del self._kept[next(iter(self._kept))]
        lease, inline = lease_of(
            placed,
            pid=os.getpid(),
            live=self._live(),
            seq=self._seq,
            channel=channel,
            slots=[m.slot for m in members],
        )
        self.counters["shared_sends"] += 1
        devices = [b for i, b in blocks.items() if i >= DEVICE_IDS]
        return Leased([encode(lease), *inline], devices)

    def grants(self, peer: bytes, leased: Leased) -> list[bytes]:
        """The records ``peer`` needs before ``leased``: a handle of each device block
        it names that the peer was not given yet (one handle per peer: see
        :class:`~zmqsync.transport.cuda.blocks.DeviceBlock`)."""
        member = self._members.get(peer)
        if member is None:
            return []
        out = []
        for block in leased.devices:
            if block.id in member.granted:
                continue
            handle = block.handle_for_peer()
            out.append(encode(DeviceGrant(block.id, os.getpid(), handle)))
            member.granted.append(block.id)
            del member.granted[:-MAX_GRANTED]
        return out

    def takes_device(self, peers: Sequence[bytes], device: Any) -> bool:
        """Whether every one of ``peers`` joined and said its model lives on GPU
        ``device``, and none keeps its versions mapped or is sent copies."""
        if self.devices is None or not peers:
            return False
        uuid = handles.IPC.uuid_of(device)
        for peer in peers:
            member = self._members.get(peer)
            if member is None or member.keeps or member.device != uuid:
                return False
        return True

    def lend_device(self, nbytes: int, device: Any) -> Any:
        if self.devices is None:
            return None
        lent = self.devices.lend_on(nbytes, device)
        return None if lent is None else lent[1]

    def _pool_of(self, block_id: int) -> BlockPool:
        if block_id >= DEVICE_IDS and self.devices is not None:
            return self.devices
        return self.pool

    def _live(self) -> list[int]:
        devices = [] if self.devices is None else self.devices.live_ids()
        return self.pool.live_ids() + devices

    def expire(self) -> None:
        """Drop the peers that held a block past :data:`LEASE_SECONDS` since it was lent
        to them (call before choosing whom a message counts)."""
        now = time.monotonic()
        for member in list(self._members.values()):
            held = member.superseded_at if member.keeps else member.lent_at
            oldest = min(held.values(), default=None)
            if oldest is not None and now - oldest > LEASE_SECONDS:
                self.counters["expired"] += 1
                pinned = len(member.leased)
                self.drop(member.peer, f"held a block for over {LEASE_SECONDS:g}s")
                self._expired[member.peer] = pinned
                while len(self._expired) > MAX_EXPIRED:
                    del self._expired[next(iter(self._expired))]

    def copying(self) -> dict[bytes, int]:
        """The peers dropped for holding a block past their lease and not joined
        again (sent every message copied, inline), each with the retired blocks it
        may still map."""
        return dict(self._expired)

    def lend(self, nbytes: int) -> Any:
        lent = self.pool.lend(nbytes)
        return None if lent is None else lent[1]

    def unwritten(self, memory: Any) -> None:
        self.pool.unwritten(memory)

    def stats(self) -> dict[str, int]:
        out = {f"shm_{k}": v for k, v in self.counters.items()}
        out["shm_bytes"] = self.pool.nbytes()
        if self.devices is not None and (self.devices.nbytes() or self.devices.refused):
            out["device_bytes"] = self.devices.nbytes()
            out["device_refused"] = self.devices.refused
        out["shm_peers"] = len(self._members)
        out["shm_copying"] = len(self._expired)
        out["shm_pinned"] = sum(self._expired.values())
        return out

    def close(self) -> None:
        self._kept.clear()
        self.pool.close()
        if self.devices is not None:
            self.devices.close()
        self._probe.close()
        self._members.clear()
        self._by_slot.clear()
        self._expired.clear()
