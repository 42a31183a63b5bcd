"""The Ray hub's lending: large frames as leases on its blocks, for the actors that can
open them (those on the driver's host); and, for the actors whose model lives on the
learner's GPU, versions in device blocks (:mod:`zmqsync.transport.cuda`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Final

from zmqsync.protocol import Buffer
from zmqsync.transport.cuda import handles
from zmqsync.transport.cuda.blocks import DevicePool
from zmqsync.transport.cuda.handles import DEVICE_IDS
from zmqsync.transport.ray.actor import owned
from zmqsync.transport.shm.blocks import Block, BlockPool, Ref
from zmqsync.transport.shm.lending import ProbeBlock, lease_of
from zmqsync.transport.shm.records import (
    NO_DEVICE,
    DeviceGrant,
    Join,
    Keeps,
    Leave,
    Release,
    TakesDevice,
    decode,
    encode,
)

__all__ = ["ActorLending", "LentPayload"]

#: Device blocks whose handle one actor is given at most before the oldest it was given
#: are forgotten (the pool has at most 3 alive; retired ones are never named again).
MAX_GRANTED: Final = 16


class LentPayload(list[bytes]):
    """A lease (what Ray sends: a list of bytes), with the blocks it names and what
    keeps them lent until it is sent."""

    def __init__(self, items: list[bytes], blocks: list[Block], keep: Any) -> None:
        super().__init__(items)
        self.blocks = blocks
        self.keep = keep

    @property
    def device(self) -> bytes | None:
        """The GPU (UUID digest) of the device blocks it names; None: it names none."""
        return next((b.uuid for b in self.blocks if b.id >= DEVICE_IDS), None)  # type: ignore[attr-defined]


class ActorLending:
    """Offers the hub's blocks to each actor once, and leases them to those that joined
    (an actor's leases are counted under its index). The hub calls it under its lock."""

    def __init__(self, *, device_memory: bool = True) -> None:
        self.pool = BlockPool()
        #: Device blocks, for actors that said their model lives on the learner's GPU.
        self.devices = DevicePool() if device_memory else None
        self._probe = ProbeBlock()
        #: Releases of leases that were never counted, and records only a hub sends.
        self.bad_releases = 0
        #: Indexes of the actors that keep each version mapped until the next (they
        #: said so: a :class:`Keeps` record): at most one per actor of the hub.
        self.keeping: set[int] = set()
        #: Actor index -> the GPU its model lives on, as it said (a UUID digest): one
        #: per actor of the hub.
        self.device_of: dict[int, bytes] = {}
        #: Actor index -> the device blocks whose handle it was given (oldest first).
        self._granted: dict[int, list[int]] = {}

    def offer(self) -> list[bytes]:
        """The message that offers an actor the hub's blocks."""
        return [encode(self._probe.offer)]

    def lend(self, nbytes: int) -> Any:
        lent = self.pool.lend(nbytes)
        return None if lent is None else lent[1]

    def unwritten(self, memory: Any) -> None:
        self.pool.unwritten(memory)

    def lend_device(self, nbytes: int, device: Any) -> Any:
        if self.devices is None:
            return None
        lent = self.devices.lend_on(nbytes, device)
        return None if lent is None else lent[1]

    def takes(self, index: int, device: Any) -> bool:
        """Whether actor ``index`` said its model lives on GPU ``device``."""
        uuid = self.device_of.get(index)
        return uuid is not None and uuid == handles.IPC.uuid_of(device)

    def payload(self, frames: Sequence[Any]) -> LentPayload | None:
        """The message as a lease on the hub's blocks (device tensors in a device block
        as places in it); None when it has no frame large enough or every block is busy."""
        keep: list[Any] = []
        if self.devices is not None and any(handles.IPC.is_device(f) for f in frames):
            frames, keep = self.devices.place_device(frames)
        placed, kept = self.pool.place(frames)
        blocks = list({f.block.id: f.block for f in placed if isinstance(f, Ref)}.values())
        if not blocks:
            return None
        lease, inline = lease_of(placed, pid=os.getpid(), live=self._live())
        return LentPayload([encode(lease), *owned(inline)], blocks, keep + kept)

    def _live(self) -> list[int]:
        devices = [] if self.devices is None else self.devices.live_ids()
        return self.pool.live_ids() + devices

    def grants(self, index: int, payload: LentPayload) -> list[list[bytes]]:
        """The messages actor ``index`` needs before ``payload``: a handle of each device
        block it names that the actor was not given yet (one handle per actor: see
        :class:`~zmqsync.transport.cuda.blocks.DeviceBlock`)."""
        given = self._granted.setdefault(index, [])
        out: list[list[bytes]] = []
        for block in payload.blocks:
            if block.id < DEVICE_IDS or block.id in given:
                continue
            handle = block.handle_for_peer()  # type: ignore[attr-defined]
            out.append([encode(DeviceGrant(block.id, os.getpid(), handle))])
            given.append(block.id)
            del given[:-MAX_GRANTED]
        return out

    def lease(self, index: int, payload: LentPayload) -> None:
        for block in payload.blocks:
            self._pool_of(block.id).lease(block, index)

    def release(self, index: int, payload: Any) -> None:
        """A message for actor ``index`` that will never be sent: release its lease."""
        if isinstance(payload, LentPayload):
            for block in payload.blocks:
                self._pool_of(block.id).release(block.id, index)

    def _pool_of(self, block_id: int) -> BlockPool:
        if block_id >= DEVICE_IDS and self.devices is not None:
            return self.devices
        return self.pool

    def on_reply(self, index: int, frame: Buffer) -> bool | None:
        """A record actor ``index`` sent back. Returns whether it joined, when it
        answered the offer; None for a release, a :class:`Keeps` or a
        :class:`TakesDevice`."""
        record = decode(frame)  # RecordError: the hub counts it
        if isinstance(record, Join | Leave):
            # A spoke that answers an offer starts afresh (a new one, in the same actor
            # maybe): it has opened no device block, and says again where its model is.
            self._granted.pop(index, None)
            self.device_of.pop(index, None)
            return isinstance(record, Join) and self._probe.proves(record)
        if isinstance(record, Keeps):
            self.keeping.add(index)
            return None
        if isinstance(record, TakesDevice):
            if record.uuid == NO_DEVICE:
                self.device_of.pop(index, None)
            else:
                self.device_of[index] = record.uuid
            return None
        if not isinstance(record, Release):
            self.bad_releases += 1  # a record only a hub sends
            return None
        for block_id in record.blocks:
            if not self._pool_of(block_id).release(block_id, index):
                self.bad_releases += 1
        return None

    def forget(self, index: int) -> None:
        """Actor ``index`` is gone: every lease it held ends."""
        self.pool.forget(index)
        if self.devices is not None:
            self.devices.forget(index)
        self.keeping.discard(index)
        self.device_of.pop(index, None)
        self._granted.pop(index, None)

    def close(self) -> None:
        self.pool.close()
        if self.devices is not None:
            self.devices.close()
        self._probe.close()
