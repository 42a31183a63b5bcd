"""A ZeroMQ spoke's side of shared memory: joining its hub's lending, reading leases in
place, and telling the hub what it still holds (see :class:`~.lending.Lender`)."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from zmqsync.protocol import Buffer
from zmqsync.transport.cuda import handles
from zmqsync.transport.cuda.handles import DEVICE_IDS
from zmqsync.transport.shm.borrowing import PeerBlocks, borrow, read_token, release_when_gone
from zmqsync.transport.shm.records import (
    DeviceGrant,
    Holding,
    Join,
    Joined,
    Keeps,
    Lease,
    Leave,
    Offer,
    RecordError,
    TakesDevice,
    decode,
    encode,
)

__all__ = ["Borrower"]

#: Device blocks in a row a spoke's device refuses to open before the spoke says it
#: takes none (each one's lease is lost and repaired meanwhile).
MAX_GONE: Final = 3

log = logging.getLogger("zmqsync.transport")


class Borrower:
    """Answers offers, reads leases in place, and reports what it still views.
    ``request(frames)`` sends to the hub's ROUTER. Called from the spoke's thread only;
    the views it hands out may die on any thread."""

    def __init__(self, request: Callable[[list[bytes]], None]) -> None:
        self._request = request
        #: The hub's offer and the token read in its probe block, once joined.
        self._offer: Offer | None = None
        self._token = b""
        self._slot: int | None = None
        self._joining = False  # a join is on its way; its answer is not
        self._secret = b""
        self._first_seq = 0
        self._seen = [0, 0]  # per channel
        self._early: tuple[Lease, list[Buffer]] | None = None  # a lease that beat our slot
        self._maps = PeerBlocks()
        self._lock = threading.Lock()
        self._held: Counter[int] = Counter()  # block id -> leases whose views live
        self._dirty = False
        self._keeps = False  # keeps each version mapped until the next: tell each join
        #: The GPU this spoke's model lives on (told on each join; device blocks come as
        #: tensors on it, each let go of only once the device is synchronized).
        self._device: torch.device | None = None
        self._gone = 0  # device blocks in a row that could not be opened (see below)
        #: It told the hub its GPU again to be given the handles anew (a lease named a
        #: block it has none of), and no handle has come since.
        self._asked_again = False
        self.counters: Counter[str] = Counter()

    @property
    def active(self) -> bool:
        """True once the hub counts this spoke: received frames may lie in its blocks."""
        return self._slot is not None

    def on_record(self, frames: Sequence[Buffer]) -> list[Buffer] | None:
        """Handle a record from the hub; returns a lease's frames, else None."""
        try:
            record = decode(frames[0])
            if isinstance(record, Offer):
                self._on_offer(record)
            elif isinstance(record, Joined) and self._offer is not None:
                self._slot, self._first_seq, self._secret = (
                    record.slot,
                    record.first_seq,
                    record.secret,
                )
                self._joining = False
                self._seen = [max(s, self._first_seq - 1) for s in self._seen]
                if self._keeps:
                    self._request([encode(Keeps())])
                if self._device is not None:
                    self._request([encode(TakesDevice(handles.gpu_name(self._device)))])
                early, self._early = self._early, None
                if early is not None:
                    return self._resolve(*early)
            elif isinstance(record, Lease):
                return self._resolve(record, list(frames[1:]))
            elif isinstance(record, DeviceGrant) and self._offer is not None:
                self._open_device_block(record)
            else:
                self.counters["bad_records"] += 1
        except (RecordError, ValueError, OSError) as exc:
            self._dirty = True  # report what was seen: the hub counts us for nothing held
            self.counters["failures"] += 1
            log.warning("could not read a shared-memory record from the hub: %s", exc)
        return None

    def keep_versions(self) -> None:
        """This worker keeps each version mapped until the next one is in: say so to the
        hub now (if joined) and on every join."""
        if not self._keeps:
            self._keeps = True
            if self._slot is not None:
                self._request([encode(Keeps())])

    def take_device(self, device: Any) -> None:
        """This spoke's model lives on GPU ``device``: say so to the hub now (if joined)
        and on every join."""
        lent = handles.lent_device(device)
        if lent is None or self._device == lent:
            return
        self._device = lent
        if self._slot is not None:
            self._request([encode(TakesDevice(handles.gpu_name(lent)))])

    def _open_device_block(self, grant: DeviceGrant) -> None:
        if self._device is None:
            return  # it took none, or refused one already: the hub is told so
        self._asked_again = False
        opened = handles.open_block(grant.block, grant.handle, gone_ok=True)
        if isinstance(opened, str):
            # The hub may have retired the block since (this spoke was stopped, and
            # dropped): the lease naming it is lost, not the device. Only a device that
            # refuses block after block is refused for good.
            self.counters["device_gone"] += 1
            self._gone += 1
            if self._gone < MAX_GONE:
                return
            opened = None
        if opened is None:
            self._device = None
            self.counters["device_refused"] += 1
            self._request([encode(TakesDevice(handles.gpu_name(None)))])
            return
        self._gone = 0
        self._maps.add(grant.block, opened, owner=grant.pid)

    def _on_offer(self, offer: Offer) -> None:
        if self._offer is not None and self._offer == offer and self._joining:
            return  # it offered before it heard our join
        # A hub offers to peers it does not count: a new one, or ours, which dropped us.
        self._offer = None
        self._slot = None
        try:
            self._token = read_token(offer)
        except (OSError, ValueError):
            self.counters["not_readable"] += 1
            self._request([encode(Leave())])
            return
        self._offer = offer
        self._join()

    def _join(self) -> None:
        self._slot = None
        self._joining = True
        self._request([encode(Join(self._token))])

    def _resolve(self, lease: Lease, inline: list[Buffer]) -> list[Buffer] | None:
        if self._offer is None or lease.pid != self._offer.pid:
            self.counters["skipped"] += 1  # not from the hub we joined
            return None
        slot = self._slot
        if slot is None:
            self._early = (lease, inline)  # joined, slot on its way: read it once it is here
            return None
        if lease.seq < self._first_seq or not lease.counts(slot):
            self.counters["skipped"] += 1
            if lease.seq >= self._first_seq and not self._joining:
                self._join()  # not counted any more (the hub dropped us): for the next ones
            return None
        self._seen[lease.channel] = max(self._seen[lease.channel], lease.seq)  # told once views die
        if any(e.block >= DEVICE_IDS and e.block not in self._maps for e in lease.entries):
            # In a device block it could not open: this message is lost (repaired); the
            # hub ends its leases once it hears this lease was seen.
            self.counters["unread_device"] += 1
            self._dirty = True
            if self._device is not None and not self._asked_again:
                # The hub believes this spoke has that block's handle (one it could not
                # open): saying its GPU again makes the hub give every handle anew.
                self._asked_again = True
                self._request([encode(TakesDevice(handles.gpu_name(self._device)))])
            return None
        if self._keeps:
            # Told at once: the hub holds the sender's frames (its window) until it hears
            # this; the block's lease, not those frames, keeps what is mapped here.
            self._dirty = True
        frames, views = borrow(lease, iter(inline), self._maps)
        with self._lock:
            self._held.update(views.keys())
        release_when_gone(views, self._let_go)
        self.counters["shared_frames"] += sum(len(v) for v in views.values())
        return frames

    def _let_go(self, block_id: int) -> None:
        device = self._device
        if block_id >= DEVICE_IDS and device is not None:
            # The copies out of it may still be queued on the device: they end first.
            handles.IPC.synchronize(device)
        with self._lock:
            self._held[block_id] -= 1
            if self._held[block_id] <= 0:
                del self._held[block_id]
                self._dirty = True

    def pending_release(self) -> list[bytes] | None:
        """The holding to send on the ack channel now (before any other message there),
        or None."""
        if not self._dirty or self._slot is None:
            return None
        with self._lock:
            self._dirty = False
            held = frozenset(self._held)
        return [encode(Holding(self._slot, self._secret, (self._seen[0], self._seen[1]), held))]

    def stats(self) -> dict[str, int]:
        """``borrowing``: 1 while the hub counts this spoke as a reader of its blocks
        (received frames may lie in them), else 0; then the ``shm_`` counts."""
        return {"borrowing": int(self.active)} | {f"shm_{k}": v for k, v in self.counters.items()}

    def forget_blocks(self) -> None:
        """A version came into the lent tensors: forget the hub's shared-memory blocks
        mapped for the versions before (each is mapped again, through ``/proc``, if a
        later lease names it), so that one the hub retires frees its memory."""
        self._maps.forget_host()

    def close(self) -> None:
        self._maps.clear()
        self._slot = None
        self._early = None
