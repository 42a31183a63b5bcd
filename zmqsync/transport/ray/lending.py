"""The Ray hub's lending: large frames as leases on its blocks, for the actors that can
open them (those on the driver's host)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from zmqsync.protocol import Buffer
from zmqsync.transport.ray.actor import owned
from zmqsync.transport.shm.blocks import Block, BlockPool, Ref
from zmqsync.transport.shm.lending import ProbeBlock, lease_of
from zmqsync.transport.shm.records import Join, Keeps, Leave, Release, decode, encode

__all__ = ["ActorLending", "LentPayload"]


class LentPayload(list[bytes]):
    """A lease (what Ray sends: a list of bytes), with the blocks it names and what
    keeps them lent until it is sent."""

    def __init__(self, items: list[bytes], blocks: list[Block], keep: Any) -> None:
        super().__init__(items)
        self.blocks = blocks
        self.keep = keep


class ActorLending:
    """Offers the hub's blocks to each actor once, and leases them to those that joined
    (an actor's leases are counted under its index). The hub calls it under its lock."""

    def __init__(self) -> None:
        self.pool = BlockPool()
        self._probe = ProbeBlock()
        #: Releases of leases that were never counted, and records only a hub sends.
        self.bad_releases = 0
        #: Indexes of the actors that keep each version mapped until the next (they
        #: said so: a :class:`Keeps` record): at most one per actor of the hub.
        self.keeping: set[int] = set()

    def offer(self) -> list[bytes]:
        """The message that offers an actor the hub's blocks."""
        return [encode(self._probe.offer)]

    def lend(self, nbytes: int) -> Any:
        lent = self.pool.lend(nbytes)
        return None if lent is None else lent[1]

    def payload(self, frames: Sequence[Buffer]) -> LentPayload | None:
        """The message as a lease on the hub's blocks; None when it has no frame large
        enough or every block is busy."""
        placed, keep = self.pool.place(frames)
        blocks = list({f.block.id: f.block for f in placed if isinstance(f, Ref)}.values())
        if not blocks:
            return None
        lease, inline = lease_of(placed, pid=os.getpid(), live=self.pool.live_ids())
        return LentPayload([encode(lease), *owned(inline)], blocks, keep)

    def lease(self, index: int, payload: LentPayload) -> None:
        for block in payload.blocks:
            self.pool.lease(block, index)

    def release(self, index: int, payload: Any) -> None:
        """A message for actor ``index`` that will never be sent: release its lease."""
        if isinstance(payload, LentPayload):
            for block in payload.blocks:
                self.pool.release(block.id, index)

    def on_reply(self, index: int, frame: Buffer) -> bool | None:
        """A record actor ``index`` sent back. Returns whether it joined, when it
        answered the offer; None for a release or a :class:`Keeps`."""
        record = decode(frame)  # RecordError: the hub counts it
        if isinstance(record, Join | Leave):
            return isinstance(record, Join) and self._probe.proves(record)
        if isinstance(record, Keeps):
            self.keeping.add(index)
            return None
        if not isinstance(record, Release):
            self.bad_releases += 1  # a record only a hub sends
            return None
        for block_id in record.blocks:
            if not self.pool.release(block_id, index):
                self.bad_releases += 1
        return None

    def forget(self, index: int) -> None:
        """Actor ``index`` is gone: every lease it held ends."""
        self.pool.forget(index)
        self.keeping.discard(index)

    def close(self) -> None:
        self.pool.close()
        self._probe.close()
